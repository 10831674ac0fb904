"""The protocol-neutral serving core of an ingress replica: the checks every request passes,
its deadline, admission, the micro-batched calls to the stages, and exactly one answer per
request, counted in the metrics and logged. The gRPC adapters (serve_app/v1.py,
serve_app/oip.py) turn their protocol's requests into Jobs and write the answers' bytes.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engines.scores import DEFAULT_TOP_K
from serve_app.answers import failed, with_total_ms
from serve_app.config import AppConfig
from serve_app.dispatch import Dispatcher
from serve_app.errors import (
    MAX_MESSAGE_CHARS,
    Code,
    DeadlineExceeded,
    InvalidArgument,
    ModelNotFound,
    Overloaded,
    clip,
    code_for,
    code_name,
    message_for,
    replica_lost,
)
from serve_app.messages import Answer, Batch, Failure, Job, Served
from serve_app.metrics import IngressMetrics

logger = logging.getLogger(__name__)
# Calls sent again after losing a stage replica (_call): once covers a replica or node lost
# mid-call; a request that itself kills replicas (say, by memory) costs at most two.
STAGE_RETRIES = 1
request_log = logging.getLogger("ray.serve")  # lands in the replica's Serve log file


@dataclass(eq=False)
class _Pending:
    job: Job | None  # None once answered
    reply: Callable[[Answer], None] | None
    stream: str
    started: float
    done: bool = False
    timer: asyncio.TimerHandle | None = None


class ServingCore:
    def __init__(
        self,
        config: AppConfig,
        model: Served,
        run: Callable[[Batch], Awaitable[list[Answer]]],
    ) -> None:
        """`model`: what is served; `run`: one call through the stages for a batch of jobs,
        answering each."""
        self._config = config
        self._limits = config.limits
        self.name, self.version, self.engine = model.name, model.version, model.engine
        self.embedding_space = model.embedding_space
        self._run = run
        self._dispatcher = Dispatcher(
            self._call,
            max_per_call=config.requests_per_call,
            max_calls=config.max_calls_in_flight,
        )
        self.requests_started = 0
        self.requests_in_flight = 0
        self._metrics = IngressMetrics()
        self._metrics_export: asyncio.Task | None = None
        # Which ingress replica answered: several share one port (SO_REUSEPORT) and the
        # kernel hashes each connection to one of them; GetModelInfo's trailing metadata
        # lets a client see where it landed.
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    # -- checks ---------------------------------------------------------------------------

    def check_model(self, name: str, version: str = "") -> None:
        """`name` may be "name" or "name/version"; empty means the served model."""
        if "/" in name and not version:
            name, version = name.split("/", 1)
        if (name and name != self.name) or version not in ("", self.version):
            asked = f"{clip(name)!r}" + (f" version {clip(version)!r}" if version else "")
            raise ModelNotFound(
                f"model {asked} is not served here; this server serves {self.name!r} "
                f"version {self.version!r}"
            )

    def top_k(self, requested: int) -> int:
        top_k = requested or DEFAULT_TOP_K
        if not 1 <= top_k <= self.engine.num_classes:
            raise InvalidArgument(f"top_k must be in 1..{self.engine.num_classes}, got {requested}")
        return top_k

    def check_embedding(self) -> None:
        """A request for embeddings needs a model that has them."""
        if not self.engine.embedding_dim:
            raise InvalidArgument(
                f"model {self.name!r} version {self.version!r} has no embedding output (it "
                f"was exported before embeddings existed); export a new version with "
                f"`raystream export` to get them"
            )

    def bounded_id(self, request_id: str) -> str:
        """`request_id` as answers echo it: cut to `max_request_id_chars` (the request is
        then refused: check_id), so no answer or log line grows with it."""
        return request_id[: self._limits.max_request_id_chars]

    def check_id(self, request_id: str) -> None:
        limit = self._limits.max_request_id_chars
        if len(request_id) > limit:
            raise InvalidArgument(
                f"request_id is {len(request_id)} characters, over the limit of {limit}; "
                f"the answer carries its first {limit}"
            )

    def check_count(self, count: int) -> None:
        limit = self._limits.max_images_per_request
        if count > limit:
            raise InvalidArgument(
                f"request has {count} images, over the limit of {limit} per request"
            )

    # -- admission and answers -----------------------------------------------------------------

    def refuse(
        self, job: Job, exc: Exception, reply: Callable[[Answer], None], stream: str
    ) -> None:
        """Answer a request that failed its checks, at once."""
        answer = failed(job, Failure(int(code_for(exc)), message_for(exc)))
        self._record(job, answer, 0.0, stream)
        reply(answer)

    def submit(
        self,
        job: Job,
        reply: Callable[[Answer], None],
        stream: str,
        budget_s: float | None = None,
    ) -> _Pending | None:
        """Run `job` through the stages; `reply` gets exactly one Answer, the result or the
        failure, by `budget_s` seconds at the latest (DEADLINE_EXCEEDED). Returns what
        `abandon` takes (None if refused at once)."""
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
        if budget_s is not None:
            late = DeadlineExceeded(f"no answer within the {budget_s * 1000:.0f} ms deadline")
            answer = failed(job, Failure(int(late.code), str(late)))
            pending.timer = asyncio.get_running_loop().call_later(
                budget_s, self._finish, pending, answer
            )
        self._dispatcher.submit(pending)
        return pending

    def abandon(self, pending: _Pending) -> None:
        """Nobody waits for this answer any more (its stream ended): if it is still queued
        it is not sent; no answer is made."""
        if not pending.done:
            pending.done = True
            if pending.timer is not None:
                pending.timer.cancel()
            self.requests_in_flight -= 1

    async def _call(self, items: list[_Pending]) -> None:
        """One call through the stages for `items`, answering each. A call that loses a stage
        replica (its process or node gone) is sent once more, with the requests that are
        still waiting: Serve routes it to another replica, or holds it until the replacement
        is up. The stages have no side effects, so running a request twice is harmless;
        a second loss answers UNAVAILABLE (clients send those again)."""
        for attempt in range(1 + STAGE_RETRIES):
            items = [item for item in items if not item.done]  # a deadline answered some
            if not items:
                return
            try:
                answers = await self._run(Batch(jobs=tuple(item.job for item in items)))
                break
            except Exception as exc:
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
        for item, answer in zip(items, answers, strict=True):
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
        self.requests_in_flight -= 1
        total_ms = (time.perf_counter() - pending.started) * 1000.0
        if pending.job.protocol == "v1":
            answer = dataclasses.replace(answer, payload=with_total_ms(answer.payload, total_ms))
        self._record(pending.job, answer, total_ms, pending.stream)
        pending.reply(answer)
        # Streams keep their pending handles until they end (to abandon what is left): a
        # finished one must not keep its request's images alive.
        pending.job, pending.reply = None, None

    # -- metrics and logs -----------------------------------------------------------------------

    def _record(self, job: Job, answer: Answer, total_ms: float, stream: str) -> None:
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
                "queue": t.queue_ms,
                "preprocess": t.preprocess_ms,
                "compute": t.inference_ms,
                "postprocess": t.postprocess_ms,
            }
            if ran
            else {},
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
        (serve_app/metrics.py: a Ray metric call per request costs too much)."""
        exported = None
        while True:
            try:
                if self.requests_in_flight != exported:
                    exported = self.requests_in_flight
                    self._metrics.in_flight.set(exported)
                self._metrics.flush()
            except Exception:  # a bug here must not stop the export for good
                logger.exception("exporting metrics failed")
            await asyncio.sleep(1.0)

    def flush_metrics(self) -> None:
        self._metrics.flush()
