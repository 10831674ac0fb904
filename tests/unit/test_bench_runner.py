"""The benchmark runner's reading of the Serve controller's log and of `nvidia-smi dmon`
(bench/run.py), its wait for a quiet server, its account of the machine's cores, and its
check of a scenario's names."""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import pytest

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


def test_deploy_began_is_read_from_the_controllers_log_in_local_time(tmp_path: Path) -> None:
    since = time.time() - 30
    at = datetime.datetime.fromtimestamp(since + 8.25).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    (tmp_path / "controller_1367.log").write_text(
        f"INFO {at} controller 1367 -- Deploying new app 'raystream'.\n" + LOG
    )
    assert abs(run.deploy_began(since, tmp_path) - 8.25) < 0.01
    assert math.isnan(run.deploy_began(time.time() + 60, tmp_path))  # an earlier server's log


# `nvidia-smi dmon -s u -d 1` on an H200 (driver 580) during a saturated load: two GPUs'
# worth of rows, one idle second (dmon pads each line with a space; stripped here).
DMON = """# gpu     sm    mem    enc    dec    jpg    ofa
# Idx      %      %      %      %      %      %
    0     93     37      0      0     89      0
    0     95     38      0      0     85      0
    1      0      0      0      0      0      0
    0     90     32      -      -     91      0
"""


def test_gpu_busy_is_each_column_averaged_over_its_rows() -> None:
    assert run.parse_dmon(DMON) == {"sm": 69.5, "jpg": 66.2, "samples": 4}


def test_no_dmon_rows_means_no_gpu_figures() -> None:
    assert run.parse_dmon("") == {}
    assert run.parse_dmon("Failed to initialize NVML: Driver/library version mismatch\n") == {}


def _burn(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


def test_settle_waits_while_the_server_is_busy_and_not_once_it_idles() -> None:
    import multiprocessing
    import os

    tree = run.ServerProcesses(os.getpid())  # this process and its children stand in
    busy = multiprocessing.get_context("spawn").Process(target=_burn, args=(4.0,))
    busy.start()
    try:
        waited = tree.settle(30.0, quiet_cores=0.5, step_s=1.0)
    finally:
        busy.join()
    assert 3.0 <= waited < 30.0  # past the burn, not to the limit
    assert tree.settle(30.0, quiet_cores=0.5, step_s=1.0) < 5.0  # two quiet steps


def test_a_window_counts_the_machines_busy_cores_beside_the_servers() -> None:
    import multiprocessing
    import os
    import threading

    tree = run.ServerProcesses(os.getpid())
    busy = multiprocessing.get_context("spawn").Process(target=_burn, args=(2.5,))
    start = time.time() + 0.5
    busy.start()
    try:
        measured = tree.measure(start, start + 2.0, threading.Event())
    finally:
        busy.join()
    assert set(measured["host_cores"]) == {"busy", "steal"}
    # The burning child's core, which the server's own count (this process' tree) has too.
    assert measured["cpu_s"] >= 1.4
    assert measured["host_cores"]["busy"] >= 0.7
    assert measured["host_cores"]["steal"] >= 0.0
    if "cgroup_throttled" in measured:  # where the cgroup's cpu.stat is readable
        assert set(measured["cgroup_throttled"]) == {"periods", "s"}


def test_the_host_probe_sees_a_stall_of_the_machine_as_a_late_wake_up() -> None:
    """A process stopped for 0.2 s (as a hypervisor holding the vCPUs would stop it) reads
    as one wake-up that much late; the rest of its 1 ms sleeps wake on time."""
    import json
    import signal
    import subprocess

    probe = run.HERE / "host_probe.py"
    start = time.time() + 3.0  # after the probe's start and calibration, on a busy machine too
    window = ["--start", str(start), "--end", str(start + 1.0)]
    child = subprocess.Popen([sys.executable, str(probe), *window], stdout=subprocess.PIPE)
    time.sleep(max(start + 0.3 - time.time(), 0))  # not a sync: into the probe's window
    child.send_signal(signal.SIGSTOP)
    time.sleep(0.2)  # the stall the probe is to see
    child.send_signal(signal.SIGCONT)
    report = json.loads(child.communicate(timeout=30)[0])
    assert report["wake_late_ms"]["max"] >= 150
    assert report["wake_late_over_5ms"] >= 1
    assert report["wakes"] >= 100
    assert report["wake_late_ms"]["p50"] < 5
    assert report["work_slowdown"]["p50"] >= 1.0
    assert "p99" in run._probe_line(report)


def test_a_scenario_name_that_yaml_reads_as_a_boolean_is_refused_clearly(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "loads:\n  - {name: half, connections: 1, in_flight: 1, images: 1}\n"
        "servers:\n  - {name: off, config: c.yaml}\n"
    )
    args = argparse.Namespace(duration=None, warmup=None, only=["off"], loads=None)
    with pytest.raises(SystemExit, match="name False must be a string"):
        run.load_scenario(scenario, args)
    scenario.write_text(scenario.read_text().replace("name: off", "name: cache-off"))
    _, servers = run.load_scenario(scenario, argparse.Namespace(**{**vars(args), "only": None}))
    assert [server["name"] for server, _ in servers] == ["cache-off"]


def test_every_shipped_scenario_loads_and_its_servers_configs_validate(
    tmp_path: Path, model_repository: Path
) -> None:
    from serve_app.config import AppConfig

    args = argparse.Namespace(duration=None, warmup=None, only=None, loads=None)
    scenarios = sorted((Path(run.__file__).parent / "scenarios").glob("*.yaml"))
    assert scenarios
    for path in scenarios:
        _, servers = run.load_scenario(path, args)
        assert servers, path
        for server, _ in servers:
            if server.get("config"):  # its `set` changes applied
                out = tmp_path / path.stem / server["name"]
                out.mkdir(parents=True)
                _, app_args = run.server_config(server, out, model_repository)
                AppConfig.model_validate(app_args)
