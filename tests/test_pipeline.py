"""Micro-batched Ray calls (serve_app/pipeline.py), without Ray: the stages' real replica
code behind stand-ins for their DeploymentHandles, the echo engine (this is about batching
calls, not labels). While a call is in flight, the requests that arrive go together in the
next one, and each keeps its own answer or failure."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest

from serve_app.config import AppConfig, EngineConfig
from serve_app.errors import DeadlineExceeded
from serve_app.inference import Inference
from serve_app.pipeline import ChainedPipeline, FusedPipeline
from serve_app.stages import Postprocess, Preprocess


class _Local:
    """Stands in for a DeploymentHandle: `handle.method.remote(*args)` runs the replica
    object's method in this process, after awaiting arguments that are earlier calls (as
    Serve resolves a DeploymentResponse). Records each call's first argument; the first
    call waits for `gate`."""

    def __init__(self, replica: object, gate: asyncio.Event | None = None) -> None:
        self.replica, self.gate, self.calls = replica, gate, []

    def __getattr__(self, name: str):
        return _Method(self, getattr(self.replica, name))


class _Method:
    def __init__(self, handle: _Local, method) -> None:
        self.handle, self.method = handle, method

    def remote(self, *args) -> asyncio.Future:
        return asyncio.ensure_future(self._run(args))

    async def _run(self, args: tuple):
        args = [await arg if isinstance(arg, asyncio.Future) else arg for arg in args]
        self.handle.calls.append(args[0])
        if self.handle.gate is not None and len(self.handle.calls) == 1:
            await self.handle.gate.wait()
        result = self.method(*args)
        return await result if inspect.isawaitable(result) else result


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


@pytest.fixture
async def config(model_repository) -> AppConfig:
    return AppConfig(
        model_repository=model_repository, engine=EngineConfig(kind="echo"), max_calls_in_flight=1
    )


async def test_chained_pipeline_carries_the_requests_queued_meanwhile_in_one_chain(
    config, photos
) -> None:
    shared = config.model_dump()
    gate = asyncio.Event()
    preprocess = _Local(Preprocess.func_or_class(shared), gate)
    inference = _Local(await Inference.func_or_class.in_process(shared))
    postprocess = _Local(Postprocess.func_or_class(shared))
    pipeline = ChainedPipeline(config, preprocess, inference, postprocess)

    first = asyncio.ensure_future(pipeline.classify([photos["chelsea"]], 1))
    await _until(lambda: len(preprocess.calls) == 1)  # the first chain runs, held at its gate
    requests = [[photos["coffee"]], [b"junk", photos["rocket"]], [photos["astronaut"]]]
    queued = [asyncio.ensure_future(pipeline.classify(images, 2)) for images in requests]
    late = asyncio.ensure_future(pipeline.classify([photos["coffee"]], 1, time.time() - 1))
    await _until(lambda: pipeline._images.queued_images == 4)  # all queued behind it
    gate.set()
    answers = await asyncio.gather(first, *queued)
    with pytest.raises(DeadlineExceeded):  # past its deadline: it fails alone
        await late

    assert [len(call) for call in preprocess.calls] == [1, 3]  # one chain for the three
    assert [len(call) for call in inference.calls] == [1, 3]
    assert [len(call) for call in postprocess.calls] == [1, 3]
    assert [len(answer.outcomes) for answer in answers] == [1, 1, 2, 1]
    junk, rocket = answers[2].outcomes
    assert junk.failure is not None and junk.failure.code == 3 and len(rocket.labels) == 2
    assert all(o.labels for a in answers for o in a.outcomes if o is not junk)


async def test_fused_pipeline_carries_the_requests_queued_meanwhile_in_one_call(
    config, photos
) -> None:
    gate = asyncio.Event()
    inference = _Local(await Inference.func_or_class.in_process(config.model_dump()), gate)
    pipeline = FusedPipeline(config, inference)

    first = asyncio.ensure_future(pipeline.classify([photos["chelsea"]], 1))
    await _until(lambda: len(inference.calls) == 1)
    queued = [
        asyncio.ensure_future(pipeline.classify(images, 1))
        for images in ([photos["coffee"]], [photos["rocket"], b"junk"])
    ]
    await _until(lambda: pipeline._calls.queued_images == 2)  # decoded here, then queued
    gate.set()
    answers = await asyncio.gather(first, *queued)

    assert [len(call) for call in inference.calls] == [1, 2]
    assert [len(answer.outcomes) for answer in answers] == [1, 1, 2]
    assert answers[2].outcomes[1].failure.code == 3 and answers[2].outcomes[0].labels
