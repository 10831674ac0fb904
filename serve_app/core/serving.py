"""The protocol-neutral serving core of an ingress replica: the checks every request passes,
its deadline, admission, the micro-batched calls to the stages, and exactly one answer per
request, counted in the metrics and logged. The gRPC adapters (serve_app/protocol/v1.py,
serve_app/protocol/oip.py) turn their protocol's requests into Jobs and write the answers' bytes.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry.trace import Span

from engines.base import EngineInfo
from engines.scores import DEFAULT_TOP_K
from serve_app.config import AppConfig
from serve_app.core.dispatch import Dispatcher, DispatchSettings
from serve_app.core.dispatch_rule import Fleet, dispatch_settings
from serve_app.core.messages import Answer, Batch, Failure, Job, Served, copied
from serve_app.core.result_cache import CachedRequests, Part, cacheable
from serve_app.errors import (
    MAX_MESSAGE_CHARS,
    Code,
    DeadlineExceeded,
    InvalidArgument,
    ModelNotFound,
    Overloaded,
    cancelled_itself,
    clip,
    code_for,
    code_name,
    message_for,
    replica_lost,
)
from serve_app.models.registry import parse_model_name
from serve_app.observability import tracing
from serve_app.observability.metrics import IngressMetrics
from serve_app.observability.tracing import RequestTrace
from serve_app.tuning import MAX_REQUEST_ID_CHARS, RETUNE_S, STAGE_RETRIES
from serve_app.wire.answers import answer_bytes_bound, failed, with_ingress_times

logger = logging.getLogger(__name__)
# What a call's requests get when the replica stops under it (its tasks cancelled).
STOPPING = Failure(int(Code.UNAVAILABLE), "the server is stopping; send the request again")


def _number(version: str) -> int:
    return int(version) if version.isdigit() else 0


request_log = logging.getLogger("ray.serve")  # lands in the replica's Serve log file


@dataclass(eq=False)
class _Pending:
    job: Job | None  # None once answered
    reply: Callable[[Answer], None] | None
    stream: str
    started: float
    sent: float = 0.0  # when a call to the stages first carried it
    done: bool = False
    timer: asyncio.TimerHandle | None = None
    cached: object = None  # under the result cache: its state there, until answered
    trace: RequestTrace | None = None  # a sampled request's spans (tracing on)


class ServingCore:
    def __init__(
        self,
        config: AppConfig,
        models: Served | list[Served],
        run: Callable[[Batch], Awaitable[list[Answer]]],
        fleet: Callable[[], Fleet] = Fleet,
        settings: Callable[[Fleet, EngineInfo], DispatchSettings] | None = None,
    ) -> None:
        """`models`: the model versions served (more come and go: `add`, `retire`); `run`:
        one call through the stages for a batch of one version's jobs, answering each;
        `fleet`: the replicas seen now, read again every RETUNE_S; `settings`: the
        dispatcher's for a fleet and an engine (default: dispatch_rule.dispatch_settings)."""
        self._config = config
        self._fleet = fleet
        self._settings = settings or self._default_settings
        self._engines: dict[str, EngineInfo] = {}  # "name/version" -> its engine, once routed
        self._applied: dict[str, DispatchSettings] = {}  # "name/version" -> its dispatcher's
        self._retune_at = 0.0
        self._limits = config.limits
        self.default = config.model  # the model of requests that name none
        self.models: dict[str, Served] = {}  # "name/version" -> what answers it
        # Each time a version is routed it gets a new number, part of the result cache's
        # keys: a version unloaded and loaded again (perhaps exported again) starts afresh.
        self._routings = itertools.count()
        self._routed: dict[str, int] = {}
        for model in [models] if isinstance(models, Served) else models:
            self.add(model)
        self._run = run
        self._dispatchers: dict[str, Dispatcher] = {}
        self.in_flight_by_model: collections.Counter[str] = collections.Counter()
        self.requests_started = 0
        self.requests_in_flight = 0
        self._metrics = IngressMetrics()
        self._cache = (
            CachedRequests(config.cache.max_bytes, self._send_part, self._finish)
            if config.cache.enabled
            else None
        )
        self._metrics_export: asyncio.Task | None = None
        # Which ingress replica answered: several share one port (SO_REUSEPORT) and the
        # kernel hashes each connection to one of them; GetModelInfo's trailing metadata
        # lets a client see where it landed.
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self.stage_transport = ""  # how calls reach the stages (its traces say so)

    # -- the model versions routed ---------------------------------------------------------

    def add(self, model: Served) -> None:
        """Route requests to `model` from now on."""
        self.models[model.key] = model
        self._engines[model.key] = model.engine
        self._routed[model.key] = next(self._routings)

    def retire(self, key: str) -> None:
        """Route no new request to `key` ("name/version"); those in flight finish."""
        self.models.pop(key, None)

    def versions(self, name: str) -> list[Served]:
        """The routed versions of `name`, lowest first."""
        found = [m for m in self.models.values() if m.name == name]
        return sorted(found, key=lambda m: (not m.version.isdigit(), _number(m.version), m.version))

    # -- the micro-batching dispatchers, one per version ------------------------------------

    def _default_settings(self, fleet: Fleet, engine: EngineInfo) -> DispatchSettings:
        direct = self._config.topology == "direct"
        return dispatch_settings(fleet, engine.device != "cpu", engine.max_batch_size, direct)

    def _settings_for(self, key: str, fleet: Fleet) -> DispatchSettings:
        """`key`'s dispatcher's settings for `fleet` (logged where they change)."""
        # a key not routed ("": jobs built without one, in tests): the first routed one
        engine = self._engines.get(key) or next(iter(self._engines.values()), None)
        if engine is None:  # no version routed yet: nothing to call
            return DispatchSettings(requests_per_call=1, calls_in_flight=1)
        settings = self._settings(fleet, engine)
        if self._applied.get(key) != settings:
            logger.info("dispatching %s: %s, for %s", key or "the default model", settings, fleet)
            self._applied[key] = settings
        return settings

    def _retune(self) -> None:
        """Every RETUNE_S: the dispatchers' settings for the replicas seen now."""
        if not self._dispatchers:  # the first is made with the fleet seen then
            return
        fleet = self._fleet()
        for key, dispatcher in self._dispatchers.items():
            dispatcher.retune(self._settings_for(key, fleet))

    def _dispatcher(self, key: str) -> Dispatcher:
        now = time.monotonic()
        if now >= self._retune_at:
            self._retune_at = now + RETUNE_S
            self._retune()
        if key not in self._dispatchers:
            self._dispatchers[key] = Dispatcher(
                lambda items: self._call(key, items),
                self._settings_for(key, self._fleet()),
                images=lambda item: item.job.count if item.job else 0,
                # the stream or connection it came on (a cached request's Part has its job)
                flow=lambda item: item.job.flow if item.job else "",
            )
        return self._dispatchers[key]

    def dispatching(self, key: str) -> DispatchSettings | None:
        """The settings `key`'s dispatcher works with (None before its first request)."""
        return self._applied.get(key)

    # -- checks ---------------------------------------------------------------------------

    def check_model(self, name: str, version: str = "", default: bool = True) -> Served:
        """The version that answers: `name` may be "name" or "name/version"; an empty name
        means the default model (NOT_FOUND where not `default`: OIP names its model), an
        empty version the highest version routed."""
        if not version:
            name, version = parse_model_name(name)
        if not name and not default:
            raise self._not_found("no model named")
        name = name or self.default
        if version and f"{name}/{version}" in self.models:
            return self.models[f"{name}/{version}"]
        served = self.versions(name)
        if served and not version:
            return served[-1]
        asked = f"{clip(name)!r}" + (f" version {clip(version)!r}" if version else "")
        raise self._not_found(f"model {asked} is not loaded")

    def _not_found(self, why: str) -> ModelNotFound:
        loaded = ", ".join(sorted(self.models)) or "none"
        return ModelNotFound(f"{why}; loaded: {loaded}")

    def top_k(self, requested: int, model: Served) -> int:
        top_k = requested or DEFAULT_TOP_K
        if not 1 <= top_k <= model.engine.num_classes:
            raise InvalidArgument(
                f"top_k must be in 1..{model.engine.num_classes}, got {requested}"
            )
        return top_k

    def check_embedding(self, model: Served) -> None:
        """A request for embeddings needs a model that has them."""
        if not model.engine.embedding_dim:
            raise InvalidArgument(
                f"model {model.name!r} version {model.version!r} has no embedding output (it "
                f"was exported before embeddings existed); export a new version with "
                f"`raystream export` to get them"
            )

    def bounded_id(self, request_id: str) -> str:
        """`request_id` as answers echo it: cut to MAX_REQUEST_ID_CHARS (the request is
        then refused: check_id), so no answer or log line grows with it."""
        return request_id[:MAX_REQUEST_ID_CHARS]

    def check_id(self, request_id: str, field: str = "request_id") -> None:
        """`field`: what the protocol calls the id (OIP: `id`)."""
        limit = MAX_REQUEST_ID_CHARS
        if len(request_id) > limit:
            raise InvalidArgument(
                f"{field} is {len(request_id)} characters, over the limit of {limit}; "
                f"the answer carries its first {limit}"
            )

    def check_count(self, count: int) -> None:
        limit = self._limits.max_images_per_request
        if count > limit:
            raise InvalidArgument(
                f"request has {count} images, over the limit of {limit} per request"
            )

    def check_answer_size(self, job: Job, model: Served) -> None:
        """Refuses, before any work, a request whose answer could pass the send limit
        (`limits.max_message_bytes`): it would be built in every stage, then not sent."""
        engine, limit = model.engine, self._limits.max_message_bytes
        bound = answer_bytes_bound(job, engine.num_classes, engine.embedding_dim, model.label_bytes)
        if bound > limit:
            raise InvalidArgument(
                f"the answer could reach {bound:,} bytes, over limits.max_message_bytes "
                f"({limit:,}): ask for fewer images, outputs or labels in one request"
            )

    # -- admission and answers -----------------------------------------------------------------

    def refuse(
        self, job: Job, exc: Exception, reply: Callable[[Answer], None], stream: str
    ) -> None:
        """Answer a request that failed its checks, at once."""
        answer = failed(job, Failure(int(code_for(exc)), message_for(exc)))
        self._record(job, answer, 0.0, stream)
        reply(answer)

    async def unary(self, start: Callable[[Callable[[Answer], None]], _Pending | None]) -> Answer:
        """A unary call's answer: `start` hands its request to the core (`submit`, or
        `refuse`) with the reply it is given. A call cancelled while it waits (the client went
        away, or its gRPC deadline passed) abandons its request, as an ended stream does."""
        future = asyncio.get_running_loop().create_future()
        pending = start(future.set_result)
        try:
            return await future
        except asyncio.CancelledError:
            if pending is not None:
                self.abandon(pending)
            raise

    def submit(
        self,
        job: Job,
        reply: Callable[[Answer], None],
        stream: str,
        budget_s: float | None = None,
        trace_parent: str = "",
    ) -> _Pending | None:
        """Run `job` through the stages; `reply` gets exactly one Answer, the result or the
        failure, by `budget_s` seconds at the latest (DEADLINE_EXCEEDED). Returns what
        `abandon` takes (None if refused at once). `trace_parent`: the client's W3C
        traceparent, if it sent one (tracing on)."""
        if self._metrics_export is None:
            self._metrics_export = asyncio.create_task(self._export_metrics())
        if self.requests_in_flight >= self._limits.max_in_flight_requests:
            overloaded = Overloaded(
                f"server has {self.requests_in_flight} requests in flight, the limit is "
                f"{self._limits.max_in_flight_requests}; retry later"
            )
            self.refuse(job, overloaded, reply, stream)
            return None
        self.requests_started += 1
        self.requests_in_flight += 1
        if budget_s is not None:  # the deadline travels with the job: stages drop it late
            job = dataclasses.replace(job, deadline=time.time() + budget_s)
        pending = _Pending(job, reply, stream, time.perf_counter())
        if tracing.enabled():
            pending.trace = tracing.start_request(job, trace_parent, stream, pending.started)
        self.in_flight_by_model[job.model] += 1
        if budget_s is not None:
            late = DeadlineExceeded(f"no answer within the {budget_s * 1000:.0f} ms deadline")
            answer = failed(job, Failure(int(late.code), str(late)))
            pending.timer = asyncio.get_running_loop().call_later(
                budget_s, self._finish, pending, answer
            )
        if self._cache is not None and cacheable(job) and job.model in self.models:
            model, routing = self.models[job.model], self._routed[job.model]
            cached = self._cache.start(pending, model, routing)  # all hits: answered at once
            if not pending.done:
                pending.cached = cached
        else:
            self._dispatcher(job.model).submit(pending)
        return pending

    def _send_part(self, part: Part) -> None:
        """The images of a request under the cache that it computes itself."""
        self._dispatcher(part.job.model).submit(part)

    def abandon(self, pending: _Pending) -> None:
        """Nobody waits for this answer any more (its stream ended): if it is still queued
        it is not sent; no answer is made. The metrics count it as CANCELLED."""
        if not pending.done:
            pending.done = True
            if pending.timer is not None:
                pending.timer.cancel()
            self._done(pending.job)
            span = None
            if pending.trace is not None:
                pending.trace.abandoned()
                span, pending.trace = pending.trace.span, None
            count = pending.job.count
            self._metrics.record(
                code="CANCELLED",
                image_codes={"CANCELLED": count} if count else {},
                total_ms=(time.perf_counter() - pending.started) * 1000.0,
                stage_ms={},
                span=span,
            )
            self._release(pending)

    def _release(self, pending: _Pending) -> None:
        """Under the result cache: what `pending` computed for other requests goes back to
        them (serve_app/core/result_cache.py)."""
        if pending.cached is not None:
            cached, pending.cached = pending.cached, None
            self._cache.release(cached)

    def _done(self, job: Job) -> None:
        self.requests_in_flight -= 1
        self.in_flight_by_model[job.model] -= 1
        if not self.in_flight_by_model[job.model]:
            del self.in_flight_by_model[job.model]

    async def _call(self, model: str, items: list[_Pending | Part]) -> None:
        """One call through the stages for `items` (all for `model`), answering each. A call
        that loses a stage replica (its process or node gone) is sent once more, with the
        requests that are still waiting: Serve routes it to another replica, or holds it
        until the replacement is up. The stages have no side effects, so running a request
        twice is harmless; a second loss answers UNAVAILABLE (clients send those again)."""
        sent = time.perf_counter()
        for item in items:
            pending = item.request.pending if isinstance(item, Part) else item
            pending.sent = pending.sent or sent
        for attempt in range(1 + STAGE_RETRIES):
            items = [item for item in items if not item.done]  # a deadline answered some
            if not items:
                return
            jobs = tuple(item.job for item in items)
            if tracing.enabled():
                jobs = self._traced(items, jobs)
            try:
                answers = await self._run(Batch(jobs=jobs, model=model))
                break
            except (Exception, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and cancelled_itself():
                    self._answer(items, [failed(item.job, STOPPING) for item in items])
                    raise  # the replica is stopping; its requests are answered all the same
                if replica_lost(exc) and attempt < STAGE_RETRIES:
                    logger.warning(
                        "a stage replica was lost during a call of %d requests (%s); "
                        "sending them again",
                        len(items),
                        message_for(exc),
                    )
                    continue
                failure = self._failure(exc, len(items), attempt)
                answers = [failed(item.job, failure) for item in items]
                break
        self._answer(items, answers)

    def _traced(self, items: list[_Pending | Part], jobs: tuple[Job, ...]) -> tuple[Job, ...]:
        """`jobs` as a call carries them: a sampled request's job with its call's span."""
        traced = list(jobs)
        for index, item in enumerate(items):
            pending = item.request.pending if isinstance(item, Part) else item
            if pending.trace is not None:
                traced[index] = pending.trace.start_call(jobs[index], self.stage_transport)
        return tuple(traced)

    def _answer(self, items: list[_Pending | Part], answers: list[Answer]) -> None:
        for item, answer in zip(items, answers, strict=True):
            if isinstance(item, Part):
                self._cache.answered(item, answer)
            else:
                self._finish(item, answer)

    @staticmethod
    def _failure(exc: Exception, requests: int, retries: int) -> Failure:
        """What a failed call answers its requests (called while handling `exc`)."""
        code = code_for(exc)
        if code == Code.INTERNAL:
            logger.exception("a call of %d requests failed", requests)
        if replica_lost(exc):
            again = " again" if retries else ""
            message = (
                f"a stage replica stopped while running this request{again} (its process "
                f"or node was lost); send it again: {message_for(exc)}"
            )
            return Failure(int(Code.UNAVAILABLE), clip(message, MAX_MESSAGE_CHARS))
        return Failure(int(code), message_for(exc))

    def _finish(self, pending: _Pending, answer: Answer) -> None:
        if pending.done:  # its deadline answered it already
            return
        pending.done = True
        if pending.timer is not None:
            pending.timer.cancel()
        self._done(pending.job)
        total_ms = (time.perf_counter() - pending.started) * 1000.0
        dispatch_ms = (pending.sent - pending.started) * 1000.0 if pending.sent else 0.0
        if pending.job.protocol == "v1":
            payload = with_ingress_times(answer.payload, total_ms, dispatch_ms)
            answer = copied(answer, payload=payload)
        span = pending.trace.span if pending.trace is not None else None
        self._record(pending.job, answer, total_ms, pending.stream, dispatch_ms, span)
        if pending.trace is not None:
            pending.trace.end(code_name(answer.code), answer.message)
            answering = time.time_ns()
        try:
            pending.reply(answer)
        except Exception:  # one caller's failure must not cost the call's other requests
            logger.exception("answering request %r failed", pending.job.id)
        finally:
            if pending.trace is not None:
                pending.trace.answered(answering)
                pending.trace = None
            # Streams keep their pending handles until they end (to abandon what is left): a
            # finished one must not keep its request's images alive.
            pending.job, pending.reply = None, None
            self._release(pending)

    # -- metrics and logs -----------------------------------------------------------------------

    def _record(
        self,
        job: Job,
        answer: Answer,
        total_ms: float,
        stream: str,
        dispatch_ms: float = 0.0,
        span: Span | None = None,
    ) -> None:
        """`span`: the request's span where it is traced (the latency's exemplar)."""
        failed_images = sum(count for code, count in answer.image_codes if code)
        image_codes = collections.Counter()
        for code, count in answer.image_codes:
            image_codes[code_name(code)] += count
        t = answer.timing
        ran = answer.code == 0 and job.count > 0
        self._metrics.record(
            code=code_name(answer.code),
            image_codes=image_codes,
            total_ms=total_ms,
            stage_ms={
                "dispatch": dispatch_ms,
                "queue": t.queue_ms,
                "preprocess": t.preprocess_ms,
                "compute": t.inference_ms,
                "postprocess": t.postprocess_ms,
            }
            if ran
            else {},
            span=span,
        )
        if answer.code or failed_images or random.random() < self._config.log_sample_rate:
            self._log(job, answer, total_ms, stream, failed_images)

    def _log(self, job: Job, answer: Answer, total_ms: float, stream: str, failed: int) -> None:
        """One JSON line per request into the replica's Serve log: every failure, and
        successes at `log_sample_rate`."""
        t = answer.timing
        request_log.info(
            json.dumps(
                {
                    "event": "raystream.request",
                    "stream": stream,
                    "request_id": job.id,
                    "code": code_name(answer.code),
                    "images": job.count,
                    "failed_images": failed,
                    "total_ms": round(total_ms, 3),
                    "queue_ms": round(t.queue_ms, 3),
                    "inference_ms": round(t.inference_ms, 3),
                    "batch_size": t.batch_size,
                    "error": answer.message or None,
                }
            )
        )

    async def _export_metrics(self) -> None:
        """Each second: the counts gathered since the last export and the in-flight gauge
        (serve_app/observability/metrics.py: a Ray metric call per request costs too much)."""
        exported = None
        while True:
            try:
                if self.requests_in_flight != exported:
                    exported = self.requests_in_flight
                    self._metrics.in_flight.set(exported)
                self.flush_metrics()
            except Exception:  # a bug here must not stop the export for good
                logger.exception("exporting metrics failed")
            await asyncio.sleep(1.0)

    def flush_metrics(self) -> None:
        if self._cache is not None:
            cache = self._cache
            self._metrics.record_cache(*cache.take_counts(), cache.cache.bytes, len(cache.cache))
        self._metrics.flush()
