"""The serving core and its micro-batched calls (serve_app/core/serving.py, dispatch.py), without
Ray or gRPC: the three stages' real code, each in a StageGroup of its own as topology chained
runs them, chained in-process; the echo engine (these tests are about batching calls and
answering each request once, not labels)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import RayServeException
from support import until

from raystream.v1 import classifier_pb2 as pb
from serve_app.config import STAGES, AppConfig, EngineConfig
from serve_app.core.dispatch import DispatchSettings
from serve_app.core.messages import Answer, Batch, Job
from serve_app.core.serving import ServingCore
from serve_app.pipeline.topology import StageGroup

DEADLINE_EXCEEDED, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE = 4, 3, 8, 14


class Chain:
    """The stage groups, one call after the other; each call's batch is recorded, and the
    first call waits for `gate`."""

    def __init__(self, groups: list[StageGroup]) -> None:
        self.groups, self.calls, self.gate = groups, [], asyncio.Event()

    async def __call__(self, batch: Batch) -> list[Answer]:
        self.calls.append(len(batch.jobs))
        if len(self.calls) == 1:
            await self.gate.wait()
        for group in self.groups:
            batch = await group.run(batch)
        return batch


@pytest.fixture
async def core(model_repository) -> tuple[ServingCore, Chain]:
    config = AppConfig(
        model_repository=model_repository,
        engine=EngineConfig(kind="echo"),
        limits={"max_in_flight_requests": 6},
    )
    groups = [await StageGroup.create(config, (stage,)) for stage in STAGES]
    chain = Chain(groups)
    chain.served = groups[1].info()
    return ServingCore(config, chain.served, chain, settings=_one_call_at_a_time), chain


def _one_call_at_a_time(fleet, engine) -> DispatchSettings:
    return DispatchSettings(requests_per_call=64, calls_in_flight=1)


def _submit(core: ServingCore, job: Job, budget_s: float | None = None) -> asyncio.Future:
    answer = asyncio.get_running_loop().create_future()
    core.submit(job, answer.set_result, "test", budget_s)
    return answer


def _response(answer: Answer) -> pb.ClassifyResponse:
    return pb.ClassifyResponse.FromString(answer.payload)


async def test_requests_queued_behind_a_call_go_together_in_the_next(core, photos) -> None:
    core, chain = core
    first = _submit(core, Job(id="first", images=(photos["chelsea"],), top_k=1))
    await until(lambda: chain.calls == [1])  # the first call runs, held at its gate
    queued = [
        _submit(core, Job(id="coffee", images=(photos["coffee"],), top_k=2)),
        _submit(core, Job(id="mixed", images=(b"junk", photos["rocket"]), top_k=2)),
        _submit(core, Job(id="astronaut", images=(photos["astronaut"],), top_k=2)),
    ]
    late = _submit(core, Job(id="late", images=(photos["coffee"],)), budget_s=0.0)
    assert (await late).code == DEADLINE_EXCEEDED  # answered by its deadline, not sent
    chain.gate.set()
    answers = [_response(a) for a in await asyncio.gather(first, *queued)]
    assert chain.calls == [1, 3]  # one call for the three queued meanwhile
    assert [a.request_id for a in answers] == ["first", "coffee", "mixed", "astronaut"]
    assert [len(a.results) for a in answers] == [1, 1, 2, 1]
    junk, rocket = answers[2].results
    assert junk.error.code == INVALID_ARGUMENT and len(rocket.labels) == 2
    assert answers[0].timing.total_ms > 0 and answers[1].timing.batch_size == 3
    # The queued ones waited in the ingress while the first call held the only call slot
    first_timing, queued_timing = answers[0].timing, answers[1].timing
    assert first_timing.dispatch_ms < queued_timing.dispatch_ms <= queued_timing.total_ms
    assert core.requests_in_flight == 0


async def test_past_the_in_flight_limit_requests_are_refused_at_once(core, photos) -> None:
    core, chain = core
    held = [_submit(core, Job(id=str(i), images=(photos["coffee"],))) for i in range(6)]
    refused = await _submit(core, Job(id="over", images=(photos["coffee"],)))
    assert refused.code == RESOURCE_EXHAUSTED and "limit is 6" in refused.message
    chain.gate.set()
    assert {a.code for a in await asyncio.gather(*held)} == {0}


async def test_an_abandoned_request_is_not_sent(core, photos) -> None:
    core, chain = core
    first = _submit(core, Job(id="first", images=(photos["chelsea"],)))
    await until(lambda: chain.calls == [1])
    answered = []
    gone = core.submit(Job(id="gone", images=(photos["coffee"],)), answered.append, "s")
    kept = _submit(core, Job(id="kept", images=(photos["coffee"],)))
    core.abandon(gone)
    chain.gate.set()
    await asyncio.gather(first, kept)
    assert chain.calls == [1, 1] and answered == [] and core.requests_in_flight == 0
    ended = core._metrics._pending  # what the next flush hands to Ray's counters
    assert ended[core._metrics.requests, "code", "CANCELLED"] == 1
    assert ended[core._metrics.images, "code", "CANCELLED"] == 1
    assert ended[core._metrics.requests, "code", "OK"] == 2


class LosesReplicas:
    """The chain, but its first `losses` calls lose a stage replica after `after_s`: Ray's
    ActorDiedError, wrapped as Serve wraps an upstream replica's death in a chained call; or
    (`cancelled`) the bare CancelledError Serve raises to a caller whose call it cancelled in
    a replica it stops."""

    def __init__(
        self, chain: Chain, losses: int, after_s: float = 0.0, cancelled: bool = False
    ) -> None:
        self.chain, self.losses, self.after_s = chain, losses, after_s
        self.cancelled = cancelled
        self.calls: list[list[str]] = []
        chain.gate.set()

    async def __call__(self, batch: Batch) -> list[Answer]:
        self.calls.append([job.id for job in batch.jobs])
        if len(self.calls) <= self.losses:
            await asyncio.sleep(self.after_s)  # simulated: the replica dies this far in
            if self.cancelled:
                raise asyncio.CancelledError
            lost = RayServeException("the upstream replica died")
            lost.__cause__ = ActorDiedError()
            raise lost
        return await self.chain(batch)


def _core_over(core: ServingCore, run: LosesReplicas) -> ServingCore:
    return ServingCore(core._config, run.chain.served, run, settings=_one_call_at_a_time)


async def test_a_call_that_loses_a_stage_replica_is_sent_again(core, photos) -> None:
    core, chain = core
    run = LosesReplicas(chain, losses=1)
    core = _core_over(core, run)
    answers = await asyncio.gather(
        _submit(core, Job(id="cat", images=(photos["chelsea"],))),
        _submit(core, Job(id="coffee", images=(photos["coffee"],))),
    )
    assert [a.code for a in answers] == [0, 0]
    # The same call again, then the next (one call at a time: "coffee" queued meanwhile)
    assert run.calls == [["cat"], ["cat"], ["coffee"]]
    assert core.requests_in_flight == 0

    run = LosesReplicas(chain, losses=1, after_s=0.1)  # the loss comes past a deadline
    core = _core_over(core, run)
    late = _submit(core, Job(id="late", images=(photos["coffee"],)), budget_s=0.02)
    kept = _submit(core, Job(id="kept", images=(photos["coffee"],)))
    assert (await late).code == DEADLINE_EXCEEDED and (await kept).code == 0
    assert run.calls == [["late"], ["kept"]]  # the first call took one; "late" not resent


async def test_a_second_loss_answers_unavailable_saying_why(core, photos) -> None:
    core, chain = core
    run = LosesReplicas(chain, losses=2)
    core = _core_over(core, run)
    answer = await _submit(core, Job(id="cat", images=(photos["chelsea"],)))
    assert answer.code == UNAVAILABLE and len(run.calls) == 2
    assert "stopped while running this request again" in answer.message
    assert "send it again" in answer.message


async def test_a_call_cancelled_under_the_core_is_sent_again_then_answered(core, photos) -> None:
    """Requests with no deadline: were the cancellation to escape, none would be answered."""
    core, chain = core
    run = LosesReplicas(chain, losses=1, cancelled=True)
    core = _core_over(core, run)
    answer = await asyncio.wait_for(_submit(core, Job(id="cat", images=(photos["chelsea"],))), 10)
    assert answer.code == 0 and run.calls == [["cat"], ["cat"]]

    run = LosesReplicas(chain, losses=2, cancelled=True)
    core = _core_over(core, run)
    answer = await asyncio.wait_for(_submit(core, Job(id="cat", images=(photos["chelsea"],))), 10)
    assert answer.code == UNAVAILABLE and "send it again" in answer.message
    assert core.requests_in_flight == 0


async def test_a_core_call_cancelled_itself_answers_its_requests(core, photos) -> None:
    """The replica stopping cancels the core's calls: their requests are answered still."""
    core, chain = core  # the first call waits for the chain's gate
    answer = _submit(core, Job(id="cat", images=(photos["chelsea"],)))
    await until(lambda: chain.calls)
    for task in core._dispatcher("")._tasks:
        task.cancel()
    assert (await asyncio.wait_for(answer, 10)).code == UNAVAILABLE
    assert core.requests_in_flight == 0


@pytest.mark.parametrize(("spread_images", "calls"), [(4, [1, 2, 2]), (0, [1, 4])])
async def test_a_burst_goes_in_calls_over_the_free_slots(
    core, photos, spread_images, calls, monkeypatch
) -> None:
    """Requests of 2 images gathered while one call runs: with `spread_images` 4 they
    go in two calls of 4 images over the two free slots, otherwise in one call."""
    import serve_app.tuning

    # each arrival ends a window of arrivals: the rate is known without waiting one out
    monkeypatch.setattr(serve_app.tuning, "RATE_WINDOW_S", 1e-9)
    core, chain = core
    settings = DispatchSettings(64, 3, gather_s=0.5, spread_images=spread_images)
    core = ServingCore(core._config, chain.served, chain, settings=lambda *_: settings)
    two = (photos["coffee"], photos["chelsea"])
    first = _submit(core, Job(id="first", images=two))
    await until(lambda: chain.calls == [1])  # held at the gate: more are expected now
    burst = [_submit(core, Job(id=f"b{i}", images=two)) for i in range(4)]
    await until(lambda: len(chain.calls) == len(calls))
    chain.gate.set()
    answers = await asyncio.gather(first, *burst)
    assert chain.calls == calls
    assert [a.code for a in answers] == [0] * 5 and core.requests_in_flight == 0
