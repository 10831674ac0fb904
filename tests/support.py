"""Helpers shared by the tests: stage batches for the tests that drive the stages directly
(GPU hosts run them too), and waiting for a condition the code under test makes true."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from raystream.v1 import classifier_pb2 as pb
from serve_app.core.messages import Batch, Job

# Model control's token (model_control.token_file) in the test servers that load and unload.
CONTROL_TOKEN = "control-secret"
CONTROL_METADATA = (("authorization", f"Bearer {CONTROL_TOKEN}"),)


def model_control(directory: Path) -> dict[str, str]:
    """The `model_control` args that allow loads and unloads with CONTROL_TOKEN, its file
    written in `directory`."""
    path = directory / "control-token"
    path.write_text(CONTROL_TOKEN + "\n")
    return {"token_file": str(path)}


def batch_of(*requests: list[bytes]) -> Batch:
    """A stage batch with one job per list of image bytes, top 1 each."""
    return Batch(
        jobs=tuple(Job(id=str(i), images=tuple(r), top_k=1) for i, r in enumerate(requests))
    )


def top_classes(answers) -> list[list[int]]:
    """Each answer's top class per image, or the image's error code."""
    responses = [pb.ClassifyResponse.FromString(a.payload) for a in answers]
    return [
        [r.labels[0].class_id if r.labels else r.error.code for r in response.results]
        for response in responses
    ]


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Returns once `condition()` holds, polling the loop; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, prelude: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """`raystream ARGS` in a process of its own, from the repository; `prelude`: Python run
    first in that process."""
    code = f"{prelude}\nimport sys\nfrom clients.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
