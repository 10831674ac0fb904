"""Which transport a stage call takes (serve_app/pipeline/topology.py StageHandle): by value over
Serve's gRPC transport only where the replicas' message limit is raised, and only for a
small batch; the object store otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from serve_app.config import MESSAGE_LIMIT_ENV
from serve_app.core.messages import Batch, Job
from serve_app.pipeline.topology import StageChain, StageHandle
from serve_app.tuning import BY_VALUE_MAX_BYTES


class FakeResponse:
    """Stands for a DeploymentResponse: which handle made it, with what argument."""

    def __init__(self, handle: FakeHandle, argument) -> None:
        self.handle, self.argument = handle, argument

    def __await__(self):  # the result, which a chain must not fetch between its calls
        yield from ()
        return ("result", self)


class FakeHandle:
    """Stands for a DeploymentHandle: `options(_by_reference=False)` gives its by-value twin;
    `run.remote(argument)` records the call and answers a FakeResponse."""

    def __init__(self, name: str = "", by_reference: bool = True) -> None:
        self.name, self.by_reference = name, by_reference
        self.deployment_name = name
        self.calls: list = []
        self.run = self  # handle.run.remote(...)

    def options(self, _by_reference: bool) -> FakeHandle:
        twin = FakeHandle(self.name, by_reference=_by_reference)
        twin.calls = self.calls  # one record of the calls, whichever twin made them
        return twin

    def remote(self, argument) -> FakeResponse:
        self.calls.append((self.by_reference, argument))
        return FakeResponse(self, argument)


def _batch(image_bytes: int) -> Batch:
    return Batch(jobs=(Job(id="a", images=(b"x" * image_bytes,)),))


def test_without_a_raised_limit_every_call_goes_through_the_object_store(monkeypatch) -> None:
    monkeypatch.delenv(MESSAGE_LIMIT_ENV, raising=False)
    stage = StageHandle(FakeHandle())
    assert stage.handle_for(_batch(10)).by_reference
    assert "object store" in stage.transport


@pytest.mark.parametrize("limit", [str(4 << 20), str(64 << 20)])
def test_a_limit_under_the_minimum_keeps_the_object_store(monkeypatch, limit: str) -> None:
    monkeypatch.setenv(MESSAGE_LIMIT_ENV, limit)
    assert StageHandle(FakeHandle()).handle_for(_batch(10)).by_reference


def test_a_raised_limit_sends_small_batches_by_value(monkeypatch) -> None:
    monkeypatch.setenv(MESSAGE_LIMIT_ENV, str(256 << 20))
    stage = StageHandle(FakeHandle())
    assert not stage.handle_for(_batch(1 << 20)).by_reference
    assert stage.handle_for(_batch(BY_VALUE_MAX_BYTES + 1)).by_reference
    assert "by value" in stage.transport


def test_a_batch_weighs_its_inputs_and_results() -> None:
    pixels = np.zeros((2, 3, 8, 8), np.float32)
    batch = Batch(
        jobs=(Job(id="a", images=(b"x" * 100, b"y" * 50)), Job(id="b", pixels=pixels)),
        jpegs=(b"z" * 10,),
        embeddings=np.zeros((3, 4), np.float32),
    )
    assert batch.nbytes() == 100 + 50 + pixels.nbytes + 10 + 48


async def test_a_chain_of_several_calls_stays_on_the_object_store(monkeypatch) -> None:
    """Each call takes the previous one's response as its argument (the batch never comes
    back through the ingress between them), which only a call by reference can pass on;
    a chain of one call goes by value where the limit allows."""
    monkeypatch.setenv(MESSAGE_LIMIT_ENV, str(1 << 30))
    preprocess, inference = FakeHandle("Preprocess"), FakeHandle("Inference")
    batch = _batch(10)
    answer = await StageChain([preprocess, inference]).run(batch)
    (first,), (second,) = preprocess.calls, inference.calls
    assert first == (True, batch)
    assert second[0] is True and isinstance(second[1], FakeResponse)
    assert second[1].handle.name == "Preprocess"  # the first call's response, not its result
    assert answer == ("result", answer[1]) and answer[1].handle.name == "Inference"
    assert answer[1].argument is second[1]
    single = FakeHandle("Inference")
    await StageChain([single]).run(batch)
    assert single.calls == [(False, batch)]  # by value
