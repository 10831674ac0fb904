"""Standard OIP clients work unchanged: Triton's own `tritonclient` (gRPC) against raystream.
It needs protobuf < 7, so it runs from its own venv, which `make test` builds (.venv-triton)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support import CONTROL_TOKEN

from conftest import ROOT

pytestmark = pytest.mark.slow
PYTHON = ROOT / ".venv-triton" / "bin" / "python"
CHECK = Path(__file__).with_name("tritonclient_check.py")  # what that venv runs
CATS = range(281, 286)
MODEL = "efficientnet-lite0"


@pytest.mark.skipif(not PYTHON.exists(), reason="needs .venv-triton: run `make triton-client`")
def test_tritonclient_infers_streams_loads_and_unloads(server, model, photos, tmp_path) -> None:
    """Also Triton's repository extension: load two versions, unload, load again (the
    server's repository holds two versions: tests/conftest.py)."""
    new = model.spec.version
    paths = []
    for name in ("chelsea", "coffee"):
        path = tmp_path / f"{name}.jpg"
        path.write_bytes(photos[name])
        paths.append(str(path))
    run = subprocess.run(
        [str(PYTHON), str(CHECK), server, f"{int(model.spec.version) - 1},{new}", *paths],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CONTROL_TOKEN": CONTROL_TOKEN},  # loads and unloads need it
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["inputs"] == ["images", "pixels"]
    assert seen["top1"][0] in CATS and seen["top1"][1] in {967, 968, 504}
    assert len(seen["labels"][0]) == 3 and int(seen["labels"][0][0].split(":")[1]) in CATS
    assert seen["bad_image_status"] == "StatusCode.INVALID_ARGUMENT"
    assert sorted(seen["stream"]) == ["0", "2"]
    assert seen["stream"]["0"] in CATS and seen["stream"]["2"] in {967, 968, 504}
    assert len(seen["stream_errors"]) == 1 and "INVALID_ARGUMENT" in seen["stream_errors"][0]
    assert seen["config"]["inputs"] == ["images", "pixels"]
    assert seen["config"]["optional"] == [True, True]  # a request carries one of them
    assert seen["config"]["outputs"][:2] == ["probabilities", "labels"]
    assert seen["config"]["max_batch_size"] >= 1
    old = str(int(new) - 1)
    assert seen["index"] == [[MODEL, old, "UNAVAILABLE"], [MODEL, new, "READY"]]
    assert seen["ready_after_load"] == [True, True]
    assert seen["ready_after_unload"] is False
    assert seen["unloaded_status"] == "StatusCode.NOT_FOUND"
    assert seen["ready_after_reload"] is True
    assert seen["index_ready"] == [[MODEL, new, "READY"]]
