"""The benchmark runner's reading of the Serve controller's log (bench/run.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import run  # bench/run.py

# Lines as Ray Serve 2.60's controller writes them.
TAIL = "Replica constructor, reconfigure method, and initial health check took 7.2s."
LOG = "\n".join(
    [
        "INFO 2026-12-02 07:39:05,101 controller 1367 -- Adding 6 replicas to "
        "Deployment(name='Inference', app='raystream').",
        "INFO 2026-12-02 07:39:05,900 controller 1367 -- Replica(id='0epgnjoz', deployment="
        f"'Inference', app='raystream') started successfully on node 'a1' after 9.0s "
        f"(PID: 1402). {TAIL}",
        "INFO 2026-12-02 07:39:06,004 controller 1367 -- Replica(id='4d8bi7rb', deployment="
        f"'Postprocess', app='raystream') started successfully on node 'a1' after 1.2s "
        f"(PID: 1399). {TAIL}",
        "INFO 2026-12-02 07:39:07,410 controller 1367 -- Replica(id='1nnzwkyk', deployment="
        f"'Inference', app='raystream') started successfully on node 'a1' after 10.5s "
        f"(PID: 1403). {TAIL}",
    ]
)


def test_replica_starts_are_read_per_deployment_from_this_runs_logs(tmp_path: Path) -> None:
    (tmp_path / "controller_1367.log").write_text(LOG)
    assert run.replica_starts(time.time() - 60, tmp_path) == {
        "Inference": [9.0, 10.5],
        "Postprocess": [1.2],
    }
    assert run.replica_starts(time.time() + 60, tmp_path) == {}  # an earlier server's log
