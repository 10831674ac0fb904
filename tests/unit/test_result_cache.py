"""The ingress' result cache (serve_app/core/result_cache.py) in the serving core, without Ray or
gRPC: the real stages and the real model in one StageGroup, run in-process; the calls counted
and held at a gate where a test is about what is in flight at once."""

from __future__ import annotations

import asyncio

import pytest
from support import until

from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.v1 import classifier_pb2 as pb
from serve_app.config import STAGES, AppConfig, EngineConfig
from serve_app.core import result_cache
from serve_app.core.dispatch import DispatchSettings
from serve_app.core.messages import Answer, Batch, Job, OipOutput
from serve_app.core.result_cache import ENTRY_OVERHEAD, ResultCache, image_keys
from serve_app.core.serving import ServingCore
from serve_app.pipeline.topology import StageGroup

DEADLINE_EXCEEDED, INTERNAL, INVALID_ARGUMENT = 4, 13, 3


class Stages:
    """The stages of one model, in-process; records each call's images and holds calls at
    `gate` while it is clear."""

    def __init__(self, group: StageGroup) -> None:
        self.group, self.calls = group, []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_next = 0  # the next calls raise (a whole call failing)

    async def __call__(self, batch: Batch) -> list[Answer]:
        self.calls.append([job.count for job in batch.jobs])
        await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("the stages broke")
        return await self.group.run(batch)

    @property
    def images(self) -> int:
        return sum(sum(call) for call in self.calls)


@pytest.fixture(scope="module")
async def group(model_repository) -> StageGroup:
    config = AppConfig(model_repository=model_repository, engine=EngineConfig(kind="onnxruntime"))
    return await StageGroup.create(config, STAGES)


def _core(
    group: StageGroup,
    model_repository,
    enabled: bool,
    max_bytes: int = 1 << 20,
    max_images_per_call: int = 0,
    **config_args: object,
):
    """One call in flight at a time, of at most `max_images_per_call` images past its first
    request (0: no bound)."""
    config = AppConfig(
        model_repository=model_repository,
        cache={"max_bytes": max_bytes if enabled else 0},
        **config_args,
    )
    stages = Stages(group)
    settings = DispatchSettings(64, 1, max_images=max_images_per_call)
    return ServingCore(config, group.info(), stages, settings=lambda *_: settings), stages


@pytest.fixture
def cached(group, model_repository) -> tuple[ServingCore, Stages]:
    return _core(group, model_repository, enabled=True)


@pytest.fixture
def uncached(group, model_repository) -> tuple[ServingCore, Stages]:
    return _core(group, model_repository, enabled=False)


def _submit(core: ServingCore, job: Job, budget_s: float | None = None) -> asyncio.Future:
    answer = asyncio.get_running_loop().create_future()
    core.submit(job, answer.set_result, "test", budget_s)
    return answer


def _v1(core: ServingCore, *images: bytes, **asked: object) -> Job:
    key = next(iter(core.models))
    return Job(id="r", images=images, model=key, **{"top_k": 3, **asked})


def _results(answer: Answer) -> bytes:
    """A v1 answer's bytes without its timing (what differs from one pass to the next)."""
    response = pb.ClassifyResponse.FromString(answer.payload)
    response.ClearField("timing")
    return response.SerializeToString()


# -- the LRU and the keys ----------------------------------------------------------------------


def test_the_cache_evicts_the_least_recently_used_past_its_bytes() -> None:
    entry = ENTRY_OVERHEAD + 16 + 100
    cache = ResultCache(max_bytes=3 * entry)
    for key in (b"a" * 16, b"b" * 16, b"c" * 16):
        cache.put(key, bytes(100))
    assert cache.bytes == 3 * entry and len(cache) == 3
    assert cache.get(b"a" * 16) is not None  # used: now the most recent
    cache.put(b"d" * 16, (bytes(60), bytes(40)))  # an OIP fragment counts its rows
    assert b"b" * 16 not in cache and b"a" * 16 in cache and cache.evictions == 1
    assert cache.bytes == 3 * entry
    cache.put(b"e" * 16, bytes(3 * entry))  # larger than the whole cache: not kept
    assert b"e" * 16 not in cache and len(cache) == 3
    cache.put(b"a" * 16, bytes(10))  # replaced: counted once
    assert cache.bytes == 3 * entry - 90


def test_the_key_holds_the_model_version_and_what_was_asked(photos) -> None:
    image = photos["chelsea"]
    base = Job(id="x", images=(image, photos["coffee"], image), model="m/2", top_k=3)
    (key, other, same) = image_keys(base)
    assert key == same != other and len(key) == 16
    assert image_keys(base, routing=1)[0] != key  # the version routed again: afresh
    oip_job = Job(
        id="x", images=(image,), model="m/2", protocol="oip",
        oip_outputs=(OipOutput("labels", "labels", 3),),
    )  # fmt: skip
    changed = [
        Job(id="x", images=(image,), model="m/1", top_k=3),
        Job(id="x", images=(image,), model="m/2", top_k=4),
        Job(id="x", images=(image,), model="m/2", top_k=3, embedding=True),
        Job(id="x", images=(image,), model="m/2", top_k=3, labels=False, embedding=True),
        oip_job,
        Job(id="x", images=(image,), model="m/2", protocol="oip",
            oip_outputs=(OipOutput("labels", "labels", 4),)),
        Job(id="x", images=(image,), model="m/2", protocol="oip",
            oip_outputs=(OipOutput("probabilities", "probabilities"),)),
    ]  # fmt: skip
    keys = [image_keys(job)[0] for job in changed]
    assert len({key, *keys}) == len(changed) + 1
    # What does not change the answer's fragment does not change the key
    assert image_keys(Job(id="y", images=(image,), model="m/2", top_k=3))[0] == key
    no_labels = Job(id="x", images=(image,), model="m/2", top_k=9, labels=False, embedding=True)
    assert image_keys(no_labels)[0] == keys[3]


# -- answers from fragments --------------------------------------------------------------------


async def test_v1_answers_from_the_cache_are_the_stages_answers(cached, uncached, photos) -> None:
    (core, stages), (plain, _) = cached, uncached
    cat, coffee, rocket = photos["chelsea"], photos["coffee"], photos["rocket"]
    for asked in ({}, {"embedding": True}, {"labels": False, "embedding": True}):
        first = await _submit(core, _v1(core, cat, b"junk", coffee, **asked))
        expected = await _submit(plain, _v1(plain, cat, b"junk", coffee, **asked))
        assert _results(first) == _results(expected)
        calls = len(stages.calls)
        # cat and coffee from the cache, the junk image again (errors are not kept), rocket new
        mixed = _v1(core, coffee, rocket, b"junk", cat, **asked)
        answer = await _submit(core, mixed)
        expected = await _submit(plain, _v1(plain, coffee, rocket, b"junk", cat, **asked))
        assert _results(answer) == _results(expected)
        assert stages.calls[calls:] == [[2]] and answer.image_codes == expected.image_codes
        response = pb.ClassifyResponse.FromString(answer.payload)
        assert response.results[2].error.code == INVALID_ARGUMENT
        assert response.timing.total_ms > 0 and response.timing.batch_size == 1  # rocket
        # All hits: answered at once, with no call
        again = await _submit(core, _v1(core, rocket, cat, **asked))
        assert stages.calls[calls:] == [[2]]
        assert _results(again) == _results(await _submit(plain, _v1(plain, rocket, cat, **asked)))
    assert core.requests_in_flight == 0


async def test_the_cache_under_a_call_bound_takes_streams_in_turn(group, model_repository, photos):
    """With a bound on the images a call carries (a CPU engine's: 128), the dispatcher takes queued
    requests stream by stream; under the cache what it queues are the requests' misses,
    which carry their request's stream too. A backlog of misses from two streams: every
    request answered."""
    core, _ = _core(group, model_repository, enabled=True, max_images_per_call=2)
    key = next(iter(core.models))
    loop = asyncio.get_running_loop()
    answers = []
    for n in range(12):
        answer = loop.create_future()
        job = Job(id=f"r{n}", images=(photos["chelsea"] + b"%d" % n,), model=key,
                  flow=f"stream-{n % 2}")  # fmt: skip
        core.submit(job, answer.set_result, f"stream-{n % 2}", None)
        answers.append(answer)
    async with asyncio.timeout(30):
        done = await asyncio.gather(*answers)
    assert [a.code for a in done] == [0] * 12
    assert core.requests_in_flight == 0


def _oip(core: ServingCore, *images: bytes) -> Job:
    outputs = (
        OipOutput("probabilities", "probabilities"),
        OipOutput("top", "labels", 3),
        OipOutput("embedding", "embedding"),
    )
    key = next(iter(core.models))
    return Job(
        id="o", images=images, model=key, protocol="oip", oip_outputs=outputs,
        top_k=3, labels=True, scores=True, embedding=True,
    )  # fmt: skip


async def test_oip_answers_from_the_cache_are_the_stages_bytes(cached, uncached, photos) -> None:
    (core, stages), (plain, _) = cached, uncached
    cat, coffee, rocket = photos["chelsea"], photos["coffee"], photos["rocket"]
    first = await _submit(core, _oip(core, cat, coffee))
    assert first.payload == (await _submit(plain, _oip(plain, cat, coffee))).payload
    answer = await _submit(core, _oip(core, coffee, rocket, cat))
    assert stages.calls == [[2], [1]]
    assert answer.payload == (await _submit(plain, _oip(plain, coffee, rocket, cat))).payload
    response = oip.ModelInferResponse.FromString(answer.payload)
    assert [list(o.shape) for o in response.outputs] == [[3, 1000], [3, 3], [3, 1280]]
    # A bad image fails an OIP request, named by its place in the request, not in the part
    failed = await _submit(core, _oip(core, cat, b"junk"))
    assert failed.code == INVALID_ARGUMENT and failed.message.startswith("image 1: ")
    assert stages.calls == [[2], [1], [1]]


async def test_a_version_routed_again_starts_afresh(cached, photos) -> None:
    core, stages = cached
    job = _v1(core, photos["chelsea"])
    for _ in range(2):
        assert (await _submit(core, job)).code == 0
    assert stages.calls == [[1]]
    served = core.models[job.model]
    core.retire(job.model)  # unloaded; loaded again (its files may have changed meanwhile)
    core.add(served)
    assert (await _submit(core, job)).code == 0
    assert stages.calls == [[1], [1]]


# -- in flight ---------------------------------------------------------------------------------


async def test_identical_images_in_flight_make_one_engine_pass(cached, photos) -> None:
    core, stages = cached
    cat, coffee, rocket = photos["chelsea"], photos["coffee"], photos["rocket"]
    stages.gate.clear()
    first = _submit(core, _v1(core, cat, coffee))
    await until(lambda: stages.calls == [[2]])  # held at the gate
    # cat twice in flight from another request, coffee too; rocket is its own
    second = _submit(core, _v1(core, coffee, rocket, cat, rocket))
    third = _submit(core, _v1(core, cat))
    stages.gate.set()
    first, second, third = await asyncio.gather(first, second, third)
    assert stages.calls == [[2], [1]] and stages.images == 3
    assert [a.code for a in (first, second, third)] == [0, 0, 0]
    cat_result, coffee_result = pb.ClassifyResponse.FromString(first.payload).results
    results = pb.ClassifyResponse.FromString(second.payload).results
    assert [results[0], results[2]] == [coffee_result, cat_result] and results[1] == results[3]
    assert pb.ClassifyResponse.FromString(third.payload).results[0] == cat_result
    assert core._cache.counts == {"hit": 0, "miss": 3, "shared": 4}
    assert core.requests_in_flight == 0 and core._cache.flights == 0


async def test_a_leader_past_its_deadline_leaves_its_followers_an_answer(cached, photos) -> None:
    core, stages = cached
    stages.gate.clear()
    leader = _submit(core, _v1(core, photos["chelsea"]), budget_s=0.05)
    await until(lambda: stages.calls == [[1]])
    follower = _submit(core, _v1(core, photos["chelsea"]))
    assert (await leader).code == DEADLINE_EXCEEDED  # its call still held at the gate
    stages.gate.set()
    answer = await follower
    assert answer.code == 0 and answer.image_codes == ((0, 1),)
    assert stages.calls == [[1], [1]]  # the follower sent the image itself
    assert core.requests_in_flight == 0 and core._cache.flights == 0


async def test_a_failed_or_abandoned_leader_leaves_its_followers_an_answer(cached, photos) -> None:
    core, stages = cached
    cat = photos["chelsea"]
    stages.gate.clear()
    stages.fail_next = 1
    leader = _submit(core, _v1(core, cat))
    await until(lambda: stages.calls == [[1]])
    follower = _submit(core, _v1(core, cat))
    stages.gate.set()
    assert (await leader).code == INTERNAL and (await follower).code == 0
    assert stages.calls == [[1], [1]]

    coffee = photos["coffee"]
    stages.gate.clear()
    gone = core.submit(_v1(core, coffee), lambda answer: None, "s")
    await until(lambda: len(stages.calls) == 3)
    follower = _submit(core, _v1(core, coffee))
    core.abandon(gone)  # its stream ended
    stages.gate.set()
    assert (await follower).code == 0 and stages.calls[2:] == [[1], [1]]
    assert core.requests_in_flight == 0 and core._cache.flights == 0


async def test_an_image_that_fails_is_sent_again_by_each_request(cached) -> None:
    core, stages = cached
    stages.gate.clear()
    first = _submit(core, _v1(core, b"junk"))
    await until(lambda: stages.calls == [[1]])
    second = _submit(core, _v1(core, b"junk"))
    stages.gate.set()
    for answer in await asyncio.gather(first, second):
        assert answer.image_codes == ((INVALID_ARGUMENT, 1),)
    assert stages.calls == [[1], [1]] and len(core._cache.cache) == 0


# -- a request's own order; callers that go away ------------------------------------------------


async def test_a_request_that_sends_anothers_images_itself_keeps_its_own_order(
    cached, uncached, photos
) -> None:
    """A request waiting on another's images sends them itself once that one is answered
    (here by its deadline): its answer lists them in its own order, not the other's."""
    (core, stages), (plain, _) = cached, uncached
    cat, coffee = photos["chelsea"], photos["coffee"]
    stages.gate.clear()
    leader = _submit(core, _v1(core, coffee, cat), budget_s=0.05)
    await until(lambda: stages.calls == [[2]])
    follower = _submit(core, _v1(core, cat, coffee))
    assert (await leader).code == DEADLINE_EXCEEDED
    stages.gate.set()
    answer = await asyncio.wait_for(follower, 10)
    assert _results(answer) == _results(await _submit(plain, _v1(plain, cat, coffee)))


async def test_images_that_failed_for_another_are_answered_in_the_requests_order(
    cached, uncached, photos
) -> None:
    (core, stages), (plain, _) = cached, uncached
    junk, cut = b"junk", photos["chelsea"][:300]  # two bad images, two different errors
    stages.gate.clear()
    leader = _submit(core, _v1(core, junk, cut))
    await until(lambda: stages.calls == [[2]])
    follower = _submit(core, _v1(core, cut, junk))  # failed for the leader: sent again
    stages.gate.set()
    await leader
    answer = await asyncio.wait_for(follower, 10)
    assert _results(answer) == _results(await _submit(plain, _v1(plain, cut, junk)))


async def test_a_cancelled_unary_call_hands_its_images_to_whoever_waits(cached, photos) -> None:
    """A unary call whose client goes away (gRPC cancels its handler) is abandoned like an
    ended stream's request: a request waiting on its images gets them and its answer."""
    core, stages = cached
    stages.gate.clear()
    job = _v1(core, photos["chelsea"])
    call = asyncio.ensure_future(core.unary(lambda reply: core.submit(job, reply, "unary")))
    await until(lambda: stages.calls == [[1]])
    follower = _submit(core, _v1(core, photos["chelsea"]))
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    stages.gate.set()
    assert (await asyncio.wait_for(follower, 10)).code == 0
    assert core._cache.flights == 0 and core.requests_in_flight == 0


async def test_a_reply_that_fails_costs_no_other_request_its_answer(uncached, photos) -> None:
    core, stages = uncached
    stages.gate.clear()
    first = _submit(core, _v1(core, photos["chelsea"]))
    await until(lambda: stages.calls == [[1]])

    def gone(answer: Answer) -> None:
        raise RuntimeError("the caller is gone")

    core.submit(_v1(core, photos["coffee"]), gone, "test")  # the next call takes both
    other = _submit(core, _v1(core, photos["rocket"]))
    stages.gate.set()
    await first
    assert (await asyncio.wait_for(other, 10)).code == 0
    assert stages.calls == [[1], [1, 1]]


# -- off ---------------------------------------------------------------------------------------


async def test_off_means_no_hashing_and_no_fragments(uncached, photos, monkeypatch) -> None:
    core, stages = uncached

    def no_hashing(job):
        raise AssertionError("hashed with the cache off")

    monkeypatch.setattr(result_cache, "image_keys", no_hashing)
    seen = []
    run = stages.__call__

    async def recording(batch: Batch) -> list[Answer]:
        seen.extend(batch.jobs)
        return await run(batch)

    core._run = recording
    answers = [await _submit(core, _v1(core, photos["chelsea"])) for _ in range(2)]
    assert [a.code for a in answers] == [0, 0] and stages.calls == [[1], [1]]
    assert not any(job.fragments for job in seen) and not any(a.fragments for a in answers)
