"""raystream.v1.ImageClassifier over a Pipeline (serve_app/pipeline.py): each request checked,
given its deadline, run, and answered exactly once, with a result or the error that says what
was wrong; every response logged (failures always, successes sampled) and counted in the
metrics. Bidi streams go through the stream runner (serve_app/streams.py); the OIP service
(serve_app/oip.py) answers through `respond()`. The Ingress deployment (serve_app/ingress.py)
serves it on its grpc.aio server.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import numpy as np

from engines import EngineInfo
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc
from serve_app.config import AppConfig
from serve_app.errors import (
    Code,
    DeadlineExceeded,
    DuplicateRequest,
    InvalidArgument,
    ModelNotFound,
    Overloaded,
    clip,
    code_for,
    message_for,
)
from serve_app.messages import Classified, Preprocessed
from serve_app.metrics import IngressMetrics
from serve_app.pipeline import Pipeline
from serve_app.preprocessing import client_pixels
from serve_app.streams import Answer, Request, StreamRunner

logger = logging.getLogger(__name__)
request_log = logging.getLogger("ray.serve")  # lands in the replica's Serve log file

DEFAULT_TOP_K = 5
REPLICA_METADATA = "raystream-replica"


class ClassifierService(pb_grpc.ImageClassifierServicer):
    """raystream.v1.ImageClassifier over a Pipeline (serve_app/pipeline.py)."""

    def __init__(
        self, config: AppConfig, model: tuple[str, str, EngineInfo], pipeline: Pipeline
    ) -> None:
        self._config = config
        self.model = model
        self._name, self._version, self._engine = model
        self._pipeline = pipeline
        self.requests_started = 0
        self.requests_in_flight = 0  # requests being answered, all streams and calls
        self._streams = StreamRunner(
            config.limits.max_in_flight_per_stream, config.limits.max_stream_buffer_bytes
        )
        self._metrics = IngressMetrics()
        self._metrics_export: asyncio.Task | None = None
        self._log_sample_rate = config.log_sample_rate
        # Which ingress replica answered: several share one port (SO_REUSEPORT) and the
        # kernel hashes each connection to one of them, so a client with few connections
        # can miss replicas; GetModelInfo's trailing metadata lets it see where it landed.
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    async def _export_metrics(self) -> None:
        """Each second: the counts gathered since the last export (serve_app/metrics.py) and
        the in-flight gauge, sampled (setting it twice per request was 3% of the direct
        topology's samples under load: py-spy)."""
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

    # -- request validation -------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model and model not in (self._name, f"{self._name}/{self._version}"):
            raise ModelNotFound(
                f"model {clip(model)!r} is not served here; this server serves "
                f"{self._name!r} version {self._version!r}"
            )

    def _top_k(self, request: pb.ClassifyRequest) -> int:
        top_k = request.top_k or DEFAULT_TOP_K
        if not 1 <= top_k <= self._engine.num_classes:
            raise InvalidArgument(
                f"top_k must be in 1..{self._engine.num_classes}, got {request.top_k}"
            )
        return top_k

    def request_id(self, request_id: str) -> str:
        """`request_id` as answers echo it: cut to `max_request_id_chars` (the request is
        then refused: check_request_id), so no answer or log line grows with it."""
        return request_id[: self._config.limits.max_request_id_chars]

    def check_request_id(self, request_id: str) -> None:
        limit = self._config.limits.max_request_id_chars
        if len(request_id) > limit:
            raise InvalidArgument(
                f"request_id is {len(request_id)} characters, over the limit of {limit}; "
                f"the answer carries its first {limit}"
            )

    # -- one request ----------------------------------------------------------------------

    async def _classify(
        self,
        request: pb.ClassifyRequest,
        budget_s: float | None,
        pixels: np.ndarray | None,
        scores: bool,
        flow: str,
    ) -> Classified:
        self._check_model(request.model)
        top_k = self._top_k(request)
        limit = self._config.limits.max_images_per_request
        count = len(request.images) if pixels is None else len(pixels)
        if count > limit:
            raise InvalidArgument(
                f"request has {count} images, over the limit of {limit} per request"
            )
        # The deadline travels with the request, so whatever stage holds it when it passes
        # drops it before the engine; the timeout answers the client on time meanwhile.
        deadline = None if budget_s is None else time.time() + budget_s
        if pixels is not None:
            indices = tuple(range(len(pixels)))
            pre = Preprocessed(len(pixels), pixels, indices, (), deadline=deadline)
            work = self._pipeline.classify_preprocessed(pre, top_k, scores)
        else:
            work = self._pipeline.classify(list(request.images), top_k, deadline, scores, flow)
        if budget_s is None:  # no timer: entering one costs microseconds a request (py-spy)
            return await work
        timer = asyncio.timeout(budget_s)
        try:
            async with timer:
                return await work
        except TimeoutError:
            if not timer.expired():
                raise
            raise DeadlineExceeded(
                f"no answer within the {budget_s * 1000:.0f} ms deadline"
            ) from None

    async def respond(
        self,
        request: pb.ClassifyRequest,
        context: grpc.aio.ServicerContext | None = None,
        pixels: np.ndarray | None = None,
        scores: bool = False,
    ) -> tuple[pb.ClassifyResponse, np.ndarray | None]:
        """One request through validation and the pipeline (the OIP service uses this);
        `pixels`: float32 (N, C, H, W) the client preprocessed, in place of `images`. With
        `scores`, also every class's probability per image, float32 (N, classes), when every
        image succeeded (else None): a matrix, where top_k = classes would build a Label
        per class and image (~2.5 ms per image: bench/oip_outputs.py)."""
        return await self._answer(request, "unary", context, pixels, scores)

    async def _respond(
        self,
        request: pb.ClassifyRequest,
        stream: str = "unary",
        context: grpc.aio.ServicerContext | None = None,
    ) -> pb.ClassifyResponse:
        response, _ = await self._answer(request, stream, context)
        return response

    async def _answer(
        self,
        request: pb.ClassifyRequest,
        stream: str,
        context: grpc.aio.ServicerContext | None,
        pixels: np.ndarray | None = None,
        scores: bool = False,
    ) -> tuple[pb.ClassifyResponse, np.ndarray | None]:
        """Exactly one response per request: the result, or the error that says why not."""
        start = time.perf_counter()
        probabilities = None
        failed: list[int] = []  # the status codes of the images that failed
        response = pb.ClassifyResponse(request_id=self.request_id(request.request_id))
        self.requests_in_flight += 1
        if self._metrics_export is None:
            self._metrics_export = asyncio.create_task(self._export_metrics())
        try:
            if self.requests_in_flight > self._config.limits.max_in_flight_requests:
                raise Overloaded(
                    f"server has {self.requests_in_flight - 1} requests in flight, the limit "
                    f"is {self._config.limits.max_in_flight_requests}; retry later"
                )
            self.check_request_id(request.request_id)
            self.requests_started += 1
            if pixels is None and request.HasField("pixels"):
                if request.images:
                    raise InvalidArgument("send images or pixels in a request, not both")
                tensor = request.pixels
                pixels = client_pixels(
                    tuple(tensor.shape), tensor.data, self._engine.input_shape, "pixels"
                )
            if request.images or pixels is not None:
                budget = _budget_s(request, context)
                # A stream is a flow of its own; unary calls share their connection's.
                flow = stream if stream != "unary" or context is None else context.peer()
                classified = await self._classify(request, budget, pixels, scores, flow)
                failed = _fill(response, classified)
                if scores:
                    rows = [outcome.scores for outcome in classified.outcomes]
                    if all(row is not None for row in rows):
                        probabilities = np.stack(rows)
            else:
                self._check_model(request.model)
                self._top_k(request)
        except Exception as exc:
            code = code_for(exc)
            if code == 13:
                logger.exception("request %r failed", response.request_id)
            response.error.code, response.error.message = int(code), message_for(exc)
            del response.results[:]
            failed = []
        finally:
            self.requests_in_flight -= 1
        response.timing.total_ms = (time.perf_counter() - start) * 1000.0
        self._record(response, stream, failed)
        return response, probabilities

    def _record(
        self, response: pb.ClassifyResponse, stream: str = "unary", failed: Sequence[int] = ()
    ) -> None:
        """Log and count one response; `failed`: the codes of its images that failed (read
        back from the protobuf results instead, they were ~3% of the servicer's own CPU)."""
        t = response.timing
        images = len(response.results)
        image_codes = collections.Counter(_code_name(code) for code in failed)
        if images > len(failed):
            image_codes["OK"] = images - len(failed)
        self._log(response, stream, failed=len(failed))
        ran = images > 0
        self._metrics.record(
            code=_code_name(response.error.code),
            image_codes=image_codes,
            total_ms=t.total_ms,
            stage_ms={
                "queue": t.queue_ms,
                "preprocess": t.preprocess_ms,
                "compute": t.inference_ms,
                "postprocess": t.postprocess_ms,
            }
            if ran
            else {},
        )

    # -- RPCs -----------------------------------------------------------------------------

    def _log(self, response: pb.ClassifyResponse, stream: str, failed: int) -> None:
        """One JSON line per request into the replica's Serve log: every failure (`failed`:
        images that failed), and successes at `log_sample_rate`."""
        if not (response.error.code or failed or random.random() < self._log_sample_rate):
            return
        t = response.timing
        request_log.info(
            json.dumps(
                {
                    "event": "raystream.request",
                    "stream": stream,
                    "request_id": response.request_id,
                    "code": _code_name(response.error.code),
                    "images": len(response.results),
                    "failed_images": failed,
                    "total_ms": round(t.total_ms, 3),
                    "queue_ms": round(t.queue_ms, 3),
                    "inference_ms": round(t.inference_ms, 3),
                    "batch_size": t.batch_size,
                    "error": response.error.message or None,
                }
            )
        )

    async def Classify(self, request_iterator, context):
        """Bidi stream: requests run concurrently, answered in completion order."""
        stream = uuid.uuid4().hex[:12]

        def duplicate(request: pb.ClassifyRequest) -> pb.ClassifyResponse:
            response = _error_response(
                request,
                DuplicateRequest(
                    f"request_id {clip(request.request_id)!r} is already in flight on this stream"
                ),
            )
            self._record(response, stream)
            return response

        async for response in self.serve_stream(
            request_iterator,
            context,
            lambda request: self._respond(request, stream, context),
            key=self._duplicate_key,
            duplicate=duplicate,
            size=pb.ClassifyRequest.ByteSize,
        ):
            yield response

    def _duplicate_key(self, request: pb.ClassifyRequest) -> str:
        """Ids over the limit are refused by _answer, never matched as duplicates."""
        request_id = request.request_id
        return "" if len(request_id) > self._config.limits.max_request_id_chars else request_id

    async def serve_stream(
        self,
        request_iterator: AsyncIterator[Request],
        context: grpc.aio.ServicerContext,
        answer: Callable[[Request], Awaitable[Answer]],
        key: Callable[[Request], str] | None = None,
        duplicate: Callable[[Request], Answer] | None = None,
        size: Callable[[Request], int] = lambda request: 0,
    ) -> AsyncIterator[Answer]:
        """A bidi stream of either protocol through the stream runner (serve_app/streams.py);
        on drain it ends UNAVAILABLE once everything it read is answered."""
        async for item in self._streams.run(request_iterator, answer, key, duplicate, size):
            yield item
        if self._streams.draining:
            # What the client sent after reading stopped was never read: safe to resend.
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "server is shutting down: requests not answered on this stream were not "
                "processed; send them again",
            )

    def drain(self) -> None:
        """Shutdown: every stream stops reading, answers what it read, then ends UNAVAILABLE."""
        self._streams.drain()

    @property
    def draining(self) -> bool:
        return self._streams.draining

    async def ClassifyOnce(self, request, context):
        return await self._respond(request, "unary", context)

    async def GetModelInfo(self, request, context):
        try:
            self._check_model(request.model)
        except ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        context.set_trailing_metadata(((REPLICA_METADATA, self.replica),))
        return pb.ModelInfo(
            name=self._name,
            version=self._version,
            engine=self._engine.engine,
            input_shape=[-1, *self._engine.input_shape],
            num_classes=self._engine.num_classes,
            max_batch_size=self._engine.max_batch_size,
            precision=self._engine.precision,
        )


def _budget_s(
    request: pb.ClassifyRequest, context: grpc.aio.ServicerContext | None
) -> float | None:
    """Seconds this request may take: its `timeout_ms` or what is left of the call's gRPC
    deadline (a stream's deadline bounds every request on it), whichever is sooner."""
    budgets = [request.timeout_ms / 1000.0] if request.timeout_ms else []
    remaining = context.time_remaining() if context is not None else None
    if remaining is not None:
        budgets.append(max(remaining, 0.0))
    return min(budgets) if budgets else None


_CODE_NAMES = {int(code): code.name for code in Code}


def _code_name(code: int) -> str:
    return _CODE_NAMES.get(code) or str(code)


def _error_response(request: pb.ClassifyRequest, exc: Exception) -> pb.ClassifyResponse:
    response = pb.ClassifyResponse(request_id=request.request_id)  # a duplicate: id in bounds
    response.error.code, response.error.message = int(code_for(exc)), message_for(exc)
    return response


def _fill(response: pb.ClassifyResponse, classified: Classified) -> list[int]:
    """`classified` into `response`; returns the status codes of the images that failed."""
    failed = []
    for outcome in classified.outcomes:
        result = response.results.add()
        if outcome.failure is not None:
            result.error.code, result.error.message = outcome.failure.code, outcome.failure.message
            failed.append(outcome.failure.code)
        for label in outcome.labels:
            result.labels.add(class_id=label.class_id, name=label.name, score=label.score)
    t = classified.timing
    response.timing.preprocess_ms = t.preprocess_ms
    response.timing.queue_ms = t.queue_ms
    response.timing.inference_ms = t.inference_ms
    response.timing.postprocess_ms = t.postprocess_ms
    response.timing.batch_size = t.batch_size
    return failed
