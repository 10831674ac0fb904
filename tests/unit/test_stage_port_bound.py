"""A stage replica's port bounds its calls by the deployment's `max_ongoing_requests`
(serve_app/transport/stage_port.py): the call past the bound is refused at once as busy, and
its caller sends it to another replica or by handle, so it is still answered, once. Real
link servers on loopback, a stage that holds its calls until the test lets them go."""

from __future__ import annotations

import asyncio

from support import until
from test_stage_port import TOKEN, Fallback, Stage, _batch

from serve_app.core.messages import Batch
from serve_app.models.registry import MemoryStore, ModelRegistry
from serve_app.transport import stage_port
from serve_app.transport.stage_port import PortCalls, StagePort


class HeldStage:
    """A stage whose calls wait until `release` is set."""

    def __init__(self) -> None:
        self.running = 0
        self.release = asyncio.Event()

    async def run(self, batch: Batch) -> list[str]:
        self.running += 1
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return ["held", *(job.id for job in batch.jobs)]


def _caller(registry: ModelRegistry, *ports: StagePort) -> tuple[PortCalls, Fallback]:
    """A caller that knows only `ports` (and reads no more addresses from the registry)."""
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN)
    calls.update({port.address: frozenset() for port in ports})
    calls.stop()
    return calls, fallback


async def test_a_replica_at_its_bound_refuses_the_next_call_which_is_answered_elsewhere(
    monkeypatch,
) -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    held = HeldStage()
    full = StagePort(held.run, TOKEN, "Inference", max_calls=lambda: 2)
    other = StagePort(Stage("other").run, TOKEN, "Inference")
    for port in (full, other):
        await port.start("127.0.0.1")
    # Another caller (another ingress replica) fills the replica's bound.
    filler, _ = _caller(registry, full)
    filling = [asyncio.create_task(filler.run(_batch())) for _ in range(2)]
    await until(lambda: held.running == 2)
    # A caller that cannot see that load (the replica is on another node) tries it first.
    monkeypatch.setattr(
        stage_port.random,
        "choice",
        lambda found: full.address if full.address in found else found[0],
    )
    calls, fallback = _caller(registry, full, other)
    assert await calls.run(_batch()) == ["other", "a"]
    assert full.refused == 1 and other.calls == 1 and fallback.batches == []
    # Where no other replica is known, the refused call goes by Serve's handle.
    alone, alone_fallback = _caller(registry, full)
    assert await alone.run(_batch()) == ["handle", "a"]
    assert full.refused == 2 and len(alone_fallback.batches) == 1
    # The refusals cost the replica nothing: it is not dropped, and takes calls once free.
    held.release.set()
    assert await asyncio.gather(*filling) == [["held", "a"], ["held", "a"]]
    assert full.in_flight == 0 and full.calls == 2
    assert await alone.run(_batch()) == ["held", "a"]
    for caller in (filler, calls, alone):
        await caller.close()
    for port in (full, other):
        await port.stop(0)


async def test_calls_by_handle_count_against_the_bound_and_no_bound_refuses_nothing() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    by_handle = 0
    bounded = StagePort(
        Stage("r1").run, TOKEN, "Inference", max_calls=lambda: 2, handle_calls=lambda: by_handle
    )
    unbounded = StagePort(Stage("r2").run, TOKEN, "Inference", handle_calls=lambda: 1000)
    for port in (bounded, unbounded):
        await port.start("127.0.0.1")
    calls, _ = _caller(registry, bounded)
    by_handle = 1
    assert await calls.run(_batch()) == ["r1", "a"]
    by_handle = 2  # the replica holds its max_ongoing_requests calls by handle
    assert await calls.run(_batch()) == ["handle", "a"]
    assert bounded.refused == 1 and bounded.calls == 1
    unbounded_calls, _ = _caller(registry, unbounded)
    results = await asyncio.gather(*(unbounded_calls.run(_batch()) for _ in range(8)))
    assert results == [["r2", "a"]] * 8 and unbounded.refused == 0
    for caller in (calls, unbounded_calls):
        await caller.close()
    for port in (bounded, unbounded):
        await port.stop(0)


def test_the_bound_is_the_deployments_max_ongoing_requests_as_serve_holds_it() -> None:
    """The Stages deployment reads it from Serve's replica context (a private field of
    Ray's; this fails where a Ray upgrade moves it)."""
    from ray.serve import context
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.config import DeploymentConfig

    from serve_app.app import _max_ongoing_requests

    replica = ReplicaID("r1", DeploymentID("Inference", "raystream"))
    saved = context._INTERNAL_REPLICA_CONTEXT
    try:
        for bound in (64, 7):  # a config change sets it again in place
            context._set_internal_replica_context(
                replica_id=replica,
                servable_object=None,
                _deployment_config=DeploymentConfig(max_ongoing_requests=bound),
                rank=None,
                world_size=1,
            )
            assert _max_ongoing_requests() == bound
    finally:
        context._INTERNAL_REPLICA_CONTEXT = saved
