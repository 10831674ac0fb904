"""Which transport a stage call takes (serve_app/pipeline/topology.py StageHandle): by value over
Serve's gRPC transport only where the replicas' message limit is raised, and only for a
small batch; the object store otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from serve_app.config import MESSAGE_LIMIT_ENV
from serve_app.core.messages import Batch, Job
from serve_app.pipeline.topology import BY_VALUE_MAX_BYTES, StageChain, StageHandle


class FakeHandle:
    """Stands for a DeploymentHandle: `options(_by_reference=False)` gives its by-value twin."""

    def __init__(self, by_reference: bool = True) -> None:
        self.by_reference = by_reference

    def options(self, _by_reference: bool) -> FakeHandle:
        return FakeHandle(by_reference=_by_reference)


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


def test_a_chain_of_several_calls_stays_on_the_object_store(monkeypatch) -> None:
    """Each call takes the previous one's response as its argument, which only a call by
    reference can pass on without bringing it back through the ingress."""
    monkeypatch.setenv(MESSAGE_LIMIT_ENV, str(1 << 30))
    assert "object store" in StageChain([FakeHandle(), FakeHandle()]).transport
    assert "by value" in StageChain([FakeHandle()]).transport
