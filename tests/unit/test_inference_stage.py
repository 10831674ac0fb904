"""The inference stage's handling of a call: requests that share engine batches keep their
own deadlines, and what a call's answers carry. The three stages' real code in one group
(as topology direct runs them), the real model's shapes, and the echo engine where an
engine must be slow on purpose."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from support import until

from clients.loadgen import model_input
from raystream.v1 import classifier_pb2 as pb
from serve_app import tuning
from serve_app.config import STAGES, AppConfig
from serve_app.core.messages import Batch, Job
from serve_app.models.registry import MemoryStore, ModelRegistry
from serve_app.pipeline.topology import StageGroup

MODEL = "efficientnet-lite0"
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNAVAILABLE = 0, 3, 4, 8, 14
ENGINE_S = 0.4  # each engine batch of the slow echo engine


@pytest.fixture
async def slow_group(model_repository) -> StageGroup:
    config = AppConfig(
        model_repository=model_repository,
        engine={"kind": "echo", "options": {"delay_ms": ENGINE_S * 1000}},
    )
    group = await StageGroup.create(config, STAGES)
    yield group
    group.stop()


def _pixels(count: int) -> np.ndarray:
    return np.zeros((count, 3, 224, 224), np.float32)


@pytest.mark.parametrize("inputs", ["photos", "pixels"])
async def test_a_short_deadline_fails_only_its_own_request(slow_group, photos, inputs) -> None:
    """Two requests in one call wait behind a busy engine: the one whose deadline passes
    meanwhile must not take the other, with a long deadline, down with it."""

    def job(request_id: str, deadline: float | None = None) -> Job:
        if inputs == "photos":
            return Job(id=request_id, images=(photos["astronaut"],), deadline=deadline)
        return Job(id=request_id, pixels=_pixels(1), deadline=deadline)

    busy = asyncio.ensure_future(slow_group.run(Batch(jobs=(job("busy"),))))
    engine = slow_group.model("").inference
    await until(lambda: engine.stalled_s() > 0)  # the engine runs `busy`: the next call queues
    now = time.time()
    short, long = await slow_group.run(
        Batch(jobs=(job("short", now + ENGINE_S / 4), job("long", now + 60)))
    )
    assert long.code == OK, long.message
    assert pb.ClassifyResponse.FromString(long.payload).request_id == "long"
    assert short.code in (OK, DEADLINE_EXCEEDED)  # nobody waits for it: either will do
    assert (await busy)[0].code == OK


async def test_an_engine_call_past_the_stall_timeout_fails_the_health_check(
    model_repository, monkeypatch
) -> None:
    """Serve replaces a replica whose health check fails: it fails while an engine call has
    run past ENGINE_STALL_TIMEOUT_S, and passes again once no call is stuck."""
    config = AppConfig(
        model_repository=model_repository,
        engine={"kind": "echo", "options": {"delay_ms": 1500}},
    )
    monkeypatch.setattr(tuning, "ENGINE_STALL_TIMEOUT_S", 0.3)
    group = await StageGroup.create(config, STAGES)
    group.check_health()  # idle
    call = asyncio.ensure_future(group.run(Batch(jobs=(Job(id="a", pixels=_pixels(1)),))))
    engine = group.model("").inference
    await until(lambda: engine.stalled_s() > 0)
    group.check_health()  # running, not yet past the timeout
    await until(lambda: engine.stalled_s() > tuning.ENGINE_STALL_TIMEOUT_S)
    with pytest.raises(RuntimeError, match=r"a GPU or engine call has run for .* it is stuck"):
        group.check_health()
    assert (await call)[0].code == OK
    group.check_health()
    group.stop()


async def test_a_version_unloading_behind_a_stuck_engine_call_still_fails_the_health_check(
    model_repository, monkeypatch
) -> None:
    """An unload waits for the batches its engine runs: while one is stuck, the version is
    gone from the routed models but its engine is still watched."""
    config = AppConfig(
        model_repository=model_repository,
        engine={"kind": "echo", "options": {"delay_ms": 1500}},
    )
    monkeypatch.setattr(tuning, "ENGINE_STALL_TIMEOUT_S", 0.3)
    registry = ModelRegistry(MemoryStore(), "test")
    group = await StageGroup.create(config, STAGES, registry, "Inference", "r1")
    (key,) = group.models
    call = asyncio.ensure_future(group.run(Batch(jobs=(Job(id="a", pixels=_pixels(1)),))))
    engine = group.model(key).inference
    await until(lambda: engine.stalled_s() > 0)
    registry.remove([key])
    await until(lambda: key not in group.models)  # the group follows the registry every POLL_S
    await until(lambda: engine.stalled_s() > tuning.ENGINE_STALL_TIMEOUT_S)
    with pytest.raises(RuntimeError, match=rf"model {key}: a GPU or engine call has run"):
        group.check_health()
    assert (await call)[0].code == UNAVAILABLE  # its version went while it ran
    assert await _passes_health_check(group, within_s=5.0)  # once the engine call ends
    group.stop()


async def _passes_health_check(group: StageGroup, within_s: float) -> bool:
    for _ in range(int(within_s / 0.05)):
        try:
            group.check_health()
            return True
        except RuntimeError:
            await asyncio.sleep(0.05)  # polling
    return False


@pytest.fixture(scope="module")
async def group(model_repository) -> StageGroup:
    """The real model on ONNX Runtime."""
    config = AppConfig(model_repository=model_repository, engine={"kind": "onnxruntime"})
    return await StageGroup.create(config, STAGES)


def _labels(answer) -> list[list[int]]:
    assert answer.code == OK, answer.message
    results = pb.ClassifyResponse.FromString(answer.payload).results
    return [[label.class_id for label in result.labels] for result in results]


async def test_each_request_of_a_call_gets_its_own_images_labels(
    group, photos, model_repository
) -> None:
    """Client tensors of several requests run together, next to decoded photos: each request
    gets the labels of its own images, in order, as when it is sent alone."""
    names = ["chelsea", "coffee", "astronaut", "rocket"]
    tensors = model_input(model_repository, MODEL, tuple(photos[n] for n in names))
    jobs = (
        Job(id="two", pixels=tensors[:2]),
        Job(id="photo", images=(photos["astronaut"],)),
        Job(id="none", pixels=tensors[:1], embedding=True, labels=False),
        Job(id="one", pixels=tensors[3:]),
        Job(id="three", pixels=tensors[1:4][::-1].copy(), top_k=2),
    )
    together = await group.run(Batch(jobs=jobs))
    alone = [(await group.run(Batch(jobs=(job,))))[0] for job in jobs]
    for job, mixed, single in zip(jobs, together, alone, strict=True):
        assert _labels(mixed) == _labels(single), job.id
    assert [len(r) for r in _labels(together[4])] == [2, 2, 2]
    assert _labels(together[0])[1][:2] == _labels(together[4])[2]  # coffee in both
    embedded = pb.ClassifyResponse.FromString(together[2].payload).results[0]
    assert not embedded.labels and len(embedded.embedding.values) == 1280


async def test_pixels_the_model_overflows_on_fail_alone(group, photos, model_repository) -> None:
    """Finite values far outside the model's range make NaN outputs: that row fails with
    INVALID_ARGUMENT, not an OK answer of NaN scores; its request's other rows and the other
    requests are answered."""
    cat = model_input(model_repository, MODEL, (photos["chelsea"],))
    huge = np.full_like(cat, 3e38)
    jobs = (
        Job(id="mixed", pixels=np.concatenate([cat, huge])),
        Job(id="vector", pixels=huge, embedding=True, labels=False),
        Job(id="cat", pixels=cat),
    )
    mixed, vector, alone = await group.run(Batch(jobs=jobs))
    results = pb.ClassifyResponse.FromString(mixed.payload).results
    assert mixed.code == OK and results[0].labels[0].class_id in range(281, 286)
    assert results[1].error.code == INVALID_ARGUMENT and "not finite" in results[1].error.message
    (result,) = pb.ClassifyResponse.FromString(vector.payload).results
    assert result.error.code == INVALID_ARGUMENT and not result.embedding.values
    assert _labels(alone) == [[label.class_id for label in results[0].labels]]


async def test_a_full_queue_refuses_only_the_requests_that_do_not_fit(group) -> None:
    """Room for 8 images: a call of 10, 2, 7 and 6 images admits the 2 and the 6 (each
    fits in what the ones before it left) and refuses the 10 and the 7."""
    (stages,) = group.models.values()
    stages.inference.reconfigure({"max_queued_images": 8})
    jobs = tuple(Job(id=f"j{n}", pixels=_pixels(n)) for n in (10, 2, 7, 6))
    answers = await group.run(Batch(jobs=jobs))
    assert [a.code for a in answers] == [RESOURCE_EXHAUSTED, OK, RESOURCE_EXHAUSTED, OK]
    assert "inference queue is full" in answers[0].message
