"""The catalog workflow against the real server (Ray Serve, topology fused, the real model):
`raystream embed --out FOLDER` killed (SIGKILL) after a commit and run again, every key once
with the server's vector; a changed manifest refused; the index built over the shards and
`raystream similar --index` finding a photo's altered copy; the Python API; an index of
another embedding space refused."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from support import run_cli

from clients.client import Client
from clients.shard_store import FAILURES, STATE, shard_paths

from conftest import ROOT, cosines, encode
from test_embeddings import TEST_SET, altered

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("server", ["fused"], indirect=True)]
CLI = "import sys\nfrom clients.cli import main\nsys.exit(main(sys.argv[1:]))"


def _tiny_images(folder: Path, n: int) -> list[Path]:
    """n distinct small JPEGs (random noise, 48x48)."""
    folder.mkdir()
    rng = np.random.default_rng(70)
    paths = []
    for i in range(n):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (48, 48, 3), np.uint8)).save(buffer, "JPEG")
        paths.append(folder / f"{i:04d}.jpg")
        paths[-1].write_bytes(buffer.getvalue())
    return paths


def _rows(out: Path) -> dict[str, np.ndarray]:
    rows: dict[str, np.ndarray] = {}
    for path in shard_paths(out):
        table = pq.read_table(path)
        vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
        for key, vector in zip(table.column("key").to_pylist(), vectors, strict=True):
            assert key not in rows, f"{key} twice"
            rows[key] = vector
    return rows


def test_embed_killed_and_run_again_writes_every_key_once(server, tmp_path) -> None:
    paths = _tiny_images(tmp_path / "photos", 160)
    (tmp_path / "photos" / "broken.jpg").write_bytes(b"not an image at all")
    manifest = tmp_path / "catalog.txt"
    manifest.write_text("".join(f"photos/{p.name}\n" for p in [*paths, Path("broken.jpg")]))
    out = tmp_path / "vectors"
    command = [
        sys.executable, "-c", CLI, "embed", "--manifest", str(manifest), "--out", str(out),
        "--server", server, "--shard-rows", "20", "--batch-size", "4", "--in-flight", "2",
    ]  # fmt: skip

    # two sender processes, killed with their parent; then three go on (any number may)
    first = subprocess.Popen(
        [*command, "--senders", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while first.poll() is None and time.monotonic() < deadline:
        state = out / STATE
        if state.is_file() and json.loads(state.read_text())["committed"]["shards"]:
            break
        time.sleep(0.05)  # polling the state file the job writes
    assert first.poll() is None, first.communicate()
    senders = Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()
    assert len(senders) == 2
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in senders) and time.monotonic() < deadline:
        time.sleep(0.05)  # the senders die with their parent
    assert not any(Path(f"/proc/{pid}").exists() for pid in senders)
    killed = json.loads((out / STATE).read_text())["committed"]
    assert 20 <= killed["vectors"] < len(paths)

    again = subprocess.run(
        [*command, "--senders", "3"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 1, again.stderr  # the broken image
    assert f"{len(paths)} vectors of 1280 floats" in again.stdout, again.stdout
    embedded_now = int(re.search(r"(\d+) embedded by this run", again.stdout)[1])
    assert embedded_now <= len(paths) - killed["vectors"]  # the committed are not sent again
    rows = _rows(out)
    assert sorted(rows) == [f"photos/{p.name}" for p in paths]
    (failure,) = [json.loads(line) for line in (out / FAILURES).read_text().splitlines()]
    assert failure["key"] == "photos/broken.jpg" and failure["code"] == "INVALID_ARGUMENT"

    async def served() -> dict:
        async with Client(server) as client:
            items = [(f"photos/{p.name}", p.read_bytes()) for p in paths[::7]]
            return {r.key: r.vector async for r in client.embed(items)}

    import asyncio

    direct = asyncio.run(served())
    keys = sorted(direct)
    assert (
        cosines(np.stack([rows[k] for k in keys]), np.stack([direct[k] for k in keys])).min()
        >= 0.9999
    )

    done = run_cli(*command[3:])  # complete: nothing more to do
    assert "0 embedded by this run" in done.stdout, done.stdout
    manifest.write_text(manifest.read_text() + "photos/0000.jpg-copy\n")
    changed = run_cli(*command[3:])
    assert changed.returncode == 2 and "Traceback" not in changed.stderr, changed.stderr
    assert "was made from another list of images" in changed.stderr, changed.stderr


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> Path:
    from skimage import data

    folder = tmp_path_factory.mktemp("catalogue")
    for name in TEST_SET:
        (folder / f"{name}.jpg").write_bytes(encode(getattr(data, name)(), quality=95))
    return folder


def test_index_build_and_similar_find_an_altered_copy(server, catalogue, tmp_path) -> None:
    out, index = tmp_path / "vectors", tmp_path / "catalog.index"
    done = run_cli("embed", str(catalogue), "--out", str(out), "--server", server)
    assert done.returncode == 0, done.stderr
    built = run_cli("index", "build", str(out), "--out", str(index))
    assert built.returncode == 0, built.stderr
    assert f"indexed {len(TEST_SET)} vectors of 1280 floats (Flat" in built.stdout, built.stdout

    query = tmp_path / "query.jpg"
    query.write_bytes(altered((catalogue / "coffee.jpg").read_bytes()))
    found = run_cli("similar", str(query), "--index", str(index), "-k", "3", "--server", server)
    assert found.returncode == 0, found.stderr
    header, *lines = found.stdout.strip().splitlines()
    assert header.split() == ["rank", "cosine", "key"] and len(lines) == 3
    assert Path(lines[0].split()[2]).name == "coffee.jpg", found.stdout


def test_the_python_api_runs_the_same_workflow(server, catalogue, tmp_path) -> None:
    from clients.catalog import build_index, embed_catalog, similar

    summary = embed_catalog(catalogue, tmp_path / "vectors", server=server, shard_rows=5)
    assert summary.complete and summary.vectors == len(TEST_SET) and summary.failures == 0
    assert len(shard_paths(tmp_path / "vectors")) == 3  # 14 rows, 5 a shard
    meta = build_index(tmp_path / "vectors", tmp_path / "catalog.index")
    assert meta.count == len(TEST_SET) and meta.embedding_space == summary.embedding_space
    query = altered((catalogue / "rocket.jpg").read_bytes())
    best = similar(tmp_path / "catalog.index", query, k=2, server=server)
    assert Path(best[0].key).name == "rocket.jpg" and best[0].score > best[1].score


def test_an_index_of_another_embedding_space_is_refused(server, photos, tmp_path) -> None:
    from clients.shard_store import JobIdentity, ShardStore
    from clients.vector_index import build_index

    job = JobIdentity("0", 2, "m", "1", "m/1/sha256:0", 1280)
    store = ShardStore(tmp_path / "old", job)
    for ordinal in range(2):
        store.add(ordinal, f"k{ordinal}", np.eye(1, 1280, ordinal, np.float32)[0])
    store.close()
    build_index(shard_paths(tmp_path / "old"), tmp_path / "old.index")
    query = tmp_path / "q.jpg"
    query.write_bytes(photos["chelsea"])
    done = run_cli(
        "similar", str(query), "--index", str(tmp_path / "old.index"), "--server", server
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "embedding space m/1/sha256:0" in done.stderr and "do not compare" in done.stderr
