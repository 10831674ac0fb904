"""Triton's own perf_analyzer measures raystream unchanged, over the Open Inference Protocol:
JPEG bytes in `images`, or preprocessed `pixels`, the model's interface read from the server
(ModelMetadata, ModelConfig: both inputs optional). It runs from its own venv, which
`make test` builds (`make perf-analyzer`)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow
PERF_ANALYZER = ROOT / "bench" / "perf_analyzer.sh"
BINARY = ROOT / ".venv-perf-analyzer" / "bin" / "perf_analyzer"
MODEL = "efficientnet-lite0"


@pytest.fixture(scope="module")
def input_data(model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("perf-analyzer")
    subprocess.run(
        [
            sys.executable,
            *(str(ROOT / "bench" / "perf_analyzer_inputs.py"), str(out)),
            *("--model-repository", str(model_repository)),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


@pytest.mark.skipif(not BINARY.exists(), reason="needs .venv-perf-analyzer: `make perf-analyzer`")
@pytest.mark.parametrize("server", ["chained"], indirect=True)
@pytest.mark.parametrize("inputs", ["images", "pixels"])
def test_perf_analyzer_measures_the_oip_endpoint(server, input_data, inputs, tmp_path) -> None:
    report = tmp_path / "report.csv"
    run = subprocess.run(
        [
            *(str(PERF_ANALYZER), "-i", "grpc", "-u", server, "-m", MODEL),
            *("--input-data", str(input_data / f"{inputs}.json"), "--concurrency-range", "2"),
            *("--measurement-interval", "1000", "--max-trials", "3"),
            *("--stability-percentage", "999", "-f", str(report)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    # perf_analyzer exits non-zero when a request fails or the model's inputs do not suit it
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = csv.DictReader(report.open())
    assert float(row["Inferences/Second"]) > 0, row
