"""`raystream serve` as a user runs it (a subprocess of the real CLI): it reports config errors
before starting anything, stops at an error retries cannot fix, and serves, changes its
batching at run time and stops on SIGTERM or SIGINT."""

import asyncio
import re

import pytest

from conftest import ROOT, free_port


def test_serve_reports_config_errors_before_starting_anything() -> None:
    import socket
    import subprocess
    import sys

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    for args, expected in (
        (["--port", "99999"], "port"),
        (["--port", str(busy.getsockname()[1])], "already listens"),
        (["--config", "nope.yaml"], "not found"),
        (["--model-repository", "/nonexistent"], "raystream export"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "clients.cli", "serve", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and "Traceback" not in result.stderr
    busy.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "topology"), [("SIGTERM", "fused"), ("SIGINT as a background job", "direct")]
)
def test_raystream_serve_starts_serves_and_stops(
    model_repository, photos, tmp_path, stop, topology
) -> None:
    """What `make serve` runs, as a user runs it: ready line, a classification, batching
    changed at run time (`raystream reconfigure`), and SIGTERM (docker stop, systemd)
    stopping everything the way Ctrl-C does; so does SIGINT sent to a `raystream serve`
    that a script started in the background (SIGINT ignored at start)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients.cli",
            "serve",
            "--port",
            str(port),
            "--model-repository",
            str(model_repository),
            "--topology",
            topology,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if stop.startswith("SIGINT")
        else None,
        start_new_session=True,  # its own process group: a failed test kills the Serve child too
    )
    try:
        ready = ""
        deadline = time.monotonic() + 240
        while "raystream ready" not in ready and time.monotonic() < deadline:
            ready = server.stdout.readline()
            assert ready or server.poll() is None, "raystream serve exited before it was ready"
        assert f"gRPC on 127.0.0.1:{port}" in ready and "efficientnet-lite0" in ready
        # ready once Serve reports every replica up, not when the first one answers
        assert "replicas running:" in ready and "Ingress 1" in ready
        assert ("Inference 1" in ready) == (topology == "fused")
        photo = tmp_path / "chelsea.jpg"
        photo.write_bytes(photos["chelsea"])
        classify = subprocess.run(
            [
                sys.executable,
                "-m",
                "clients.cli",
                "classify",
                "--server",
                f"127.0.0.1:{port}",
                str(photo),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert classify.returncode == 0 and "cat" in classify.stdout, classify.stdout
        # Batching changed at run time: a queue of one image refuses a request of two.
        cluster = re.search(r"Ray cluster ([^;]+);", ready).group(1)
        for change, answer in (("max_queued_images=1", 8), ("max_queued_images=null", 0)):
            reconfigure = subprocess.run(
                [
                    *(sys.executable, "-m", "clients.cli", "reconfigure", change),
                    *("--address", cluster, "--port", str(port), "--topology", topology),
                    *("--model-repository", str(model_repository)),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert reconfigure.returncode == 0, reconfigure.stderr[-2000:]
            batching = "Inference" if topology == "fused" else "Ingress"
            assert f"{batching} user_config now" in reconfigure.stdout
            response = asyncio.run(_classify_once(f"127.0.0.1:{port}", [photo.read_bytes()] * 2))
            assert response.error.code == answer, response.error  # 8: RESOURCE_EXHAUSTED
        server.send_signal(signal.SIGINT if stop.startswith("SIGINT") else signal.SIGTERM)
        assert server.wait(timeout=60) is not None
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


async def _classify_once(address: str, images: list[bytes]):
    from clients.client import Client

    async with Client(address) as client:
        return await client.classify_once(images, top_k=1)


@pytest.mark.slow
def test_raystream_serve_stops_at_an_error_retries_cannot_fix(model_repository) -> None:
    """A GPU engine on a machine without a GPU: Serve would retry the replica for minutes;
    `raystream serve` stops at the first failure and says why in one line."""
    import subprocess
    import sys

    from engines import pick_engine

    if pick_engine("auto") != "onnxruntime":
        pytest.skip("this machine has a GPU: torch-cuda would start")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clients.cli",
            "serve",
            "--port",
            "0",
            "--engine",
            "torch-cuda",
            "--model-repository",
            str(model_repository),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 1
    assert "raystream: cannot start: engine 'torch-cuda' needs a CUDA GPU" in result.stderr
