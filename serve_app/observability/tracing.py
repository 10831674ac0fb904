"""OpenTelemetry traces of requests, across the ingress and the stage replicas.

Off by default (`tracing.otlp_endpoint` unset); then every helper here returns at its first `if` and
creates nothing. On, each process builds one tracer (`configure`) with parent-based head
sampling: a request whose client sent a sampled W3C `traceparent` (gRPC metadata) is always
traced, one sent unsampled never, and the others at `sample_ratio`. Spans go in batches over
OTLP gRPC to `otlp_endpoint`, with the request latency histogram whose buckets carry
sampled requests' trace ids as exemplars (serve_app/observability/exemplars.py).

A traced request's context travels with its `Job` (`Job.trace`, a traceparent string; empty
for a request not traced), over a stage port and through a Serve handle alike. Each process
records its own spans and sets `Job.trace` to the span the next one hangs under:

    raystream.request                      ingress: from admission to the answer
      raystream.dispatch_wait              admission to the call that carries it (queueing)
      raystream.stage_call                 the call through the stages (transport)
        raystream.stage Preprocess         a stage replica (deployment, replica, node)
          raystream.decode                 images, bytes, cpu or gpu, crop size
          raystream.stage Inference        (the next group's span hangs under the last)
            raystream.batch_wait           waiting for an engine batch; the batch size formed
            raystream.engine               the engine's pass (wall time; GPU time from
                                           CUDA events on a GPU engine: raystream.gpu_ms)
            raystream.stage Postprocess
      raystream.answer                     the answer written on the stream

Stage work is shared by the batch's requests: each traced request gets its own spans of it,
with the batch's figures as attributes. The spans of a stage are recorded after its work,
with the times it measured, so no stage code changes shape when tracing is on.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serve_app.config import TracingConfig
from serve_app.core.messages import Batch, Job, copied
from serve_app.observability import exemplars
from serve_app.tuning import TRACE_EXPORT_DELAY_S
from serve_app.wire.request_images import buffers

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # W3C trace context, as gRPC metadata (lower case)
_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: tracing off in this process
_provider: TracerProvider | None = None


@dataclass(frozen=True)
class Export:
    """Where and how this process exports its spans and exemplar histograms."""

    endpoint: str  # host:port of an OTLP gRPC collector (plaintext)
    sample_ratio: float
    delay_s: float  # how long finished spans wait before they are sent; the metrics' interval


def export_settings(config: TracingConfig) -> Export | None:
    """The tracing config as this module uses it; None when tracing is off. (The one place
    that reads TracingConfig's fields.)"""
    if not config.enabled:
        return None
    return Export(config.otlp_endpoint, config.sample_ratio, TRACE_EXPORT_DELAY_S)


def configure(config: TracingConfig, process: str) -> None:
    """Set up this process' tracer and exemplar histograms once (`process`: its deployment,
    as the resource's `raystream.deployment`); nothing when tracing is off."""
    global _tracer, _provider
    settings = export_settings(config)
    if settings is None or _tracer is not None:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    resource = Resource.create(
        {
            "service.name": "raystream",
            # each replica's own series in Prometheus (the collector's `instance` label)
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
            "raystream.deployment": process,
            "process.pid": os.getpid(),
        }
    )
    sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
    _provider = TracerProvider(sampler=sampler, resource=resource)
    exporter = OTLPSpanExporter(endpoint=settings.endpoint, insecure=True)
    delay_ms = int(settings.delay_s * 1000)
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms))
    _tracer = _provider.get_tracer("raystream")
    exemplars.configure(settings.endpoint, settings.delay_s, resource)
    logger.info("tracing on: sample ratio %g, OTLP to %s", settings.sample_ratio, settings.endpoint)


def enabled() -> bool:
    return _tracer is not None


def flush(timeout_s: float = 5.0) -> bool:
    """Export what is finished now (a replica stopping; tests)."""
    spans = _provider is None or _provider.force_flush(int(timeout_s * 1000))
    return exemplars.flush(timeout_s) and spans


def client_parent(context: object) -> str:
    """The traceparent a client sent in its gRPC call's metadata (`context`: the call's
    ServicerContext); "" when none, or tracing off."""
    if _tracer is None or context is None:
        return ""
    metadata: Iterable[tuple[str, object]] = context.invocation_metadata() or ()
    for key, value in metadata:
        if key == TRACEPARENT and isinstance(value, str):
            return value
    return ""


def _context(traceparent: str) -> Context:
    return _propagator.extract({TRACEPARENT: traceparent})


def traceparent(span: Span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _ns(perf_s: float) -> int:
    """A time.perf_counter() reading as epoch nanoseconds (what spans take)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


# -- the ingress ---------------------------------------------------------------------------


@dataclass(eq=False)
class RequestTrace:
    """One sampled request's spans at the ingress."""

    span: Span
    started: int  # epoch ns
    call: Span | None = None  # the stage call in flight

    def start_call(self, job: Job, transport: str) -> Job:
        """The request goes in a call through the stages: its queueing ends (a request sent
        again after a lost replica keeps its first wait), and `job` carries the call's span."""
        now = time.time_ns()
        parent = trace.set_span_in_context(self.span)
        if self.call is None:
            wait = _tracer.start_span("raystream.dispatch_wait", parent, start_time=self.started)
            wait.end(now)
        else:
            self.call.end(now)
        self.call = _tracer.start_span(
            "raystream.stage_call",
            parent,
            kind=SpanKind.CLIENT,
            start_time=now,
            attributes={"raystream.transport": transport},
        )
        return copied(job, trace=traceparent(self.call))

    def end(self, code: str, message: str) -> None:
        """The answer is made: `code` its status name; the answer span lasts while it is
        handed to the stream (`answered`)."""
        now = time.time_ns()
        if self.call is not None:
            self.call.end(now)
        self.span.set_attribute("rpc.grpc.status_code", code)
        if code != "OK":
            self.span.set_status(Status(StatusCode.ERROR, message))

    def abandoned(self) -> None:
        """Nobody waits for the answer any more (the client went away)."""
        self.end("CANCELLED", "the client went away")
        self.span.end()

    def answered(self, started: int) -> None:
        parent = trace.set_span_in_context(self.span)
        _tracer.start_span("raystream.answer", parent, start_time=started).end()
        self.span.end()


def start_request(job: Job, parent: str, stream: str, started: float) -> RequestTrace | None:
    """A request's root span at the ingress from `started` (perf_counter, the instant its
    latency counts from), under its client's `parent` traceparent if it sent one; None where
    tracing is off or the request is not sampled."""
    if _tracer is None:
        return None
    start_ns = _ns(started)
    span = _tracer.start_span(
        "raystream.request",
        _context(parent) if parent else None,
        kind=SpanKind.SERVER,
        attributes={
            "raystream.request_id": job.id,
            "raystream.protocol": job.protocol,
            "raystream.model": job.model,
            "raystream.images": job.count,
            "raystream.stream": stream,
        },
        start_time=start_ns,
    )
    if not span.is_recording():
        return None
    return RequestTrace(span, start_ns)


# -- a stage replica -----------------------------------------------------------------------


class StageTrace:
    """A batch's spans in one stage group, for its traced requests."""

    def __init__(self, batch: Batch, attributes: dict[str, object]) -> None:
        self._started = time.time_ns()
        self._spans: dict[int, Span] = {}
        for index, job in enumerate(batch.jobs):
            if job.trace:
                self._spans[index] = _tracer.start_span(
                    f"raystream.stage {attributes['raystream.deployment']}",
                    _context(job.trace),
                    kind=SpanKind.SERVER,
                    start_time=self._started,
                    attributes={**attributes, "raystream.requests_in_batch": len(batch.jobs)},
                )

    def _child(self, name: str, start: int, end: int, attributes: dict[str, object]) -> None:
        for span in self._spans.values():
            context = trace.set_span_in_context(span)
            _tracer.start_span(name, context, start_time=start, attributes=attributes).end(end)

    def decoded(self, started: float, before: Batch, after: Batch, on: str) -> None:
        """The preprocess stage ran from `started` (perf_counter) until now."""
        crops = after.crops
        shape = tuple(getattr(crops, "shape", ()))[1:3]
        self._child(
            "raystream.decode",
            _ns(started),
            time.time_ns(),
            {
                "raystream.decode": on,
                "raystream.images": sum(job.count for job in before.jobs),
                "raystream.image_bytes": sum(
                    len(image) for job in before.jobs for image in buffers(job.images)
                ),
                "raystream.crop_size": f"{shape[0]}x{shape[1]}" if len(shape) == 2 else "",
                "raystream.jpegs_for_gpu": len(after.jpegs),
            },
        )

    def inferred(self, started: float, after: Batch) -> None:
        """The inference stage ran from `started` (perf_counter) until now: its batch wait
        and its engine pass, as the stage timed them (StageTiming)."""
        timing, start = after.timing, _ns(started)
        waited = start + int(timing.queue_ms * 1e6)
        self._child(
            "raystream.batch_wait", start, waited, {"raystream.batch_size": timing.batch_size}
        )
        ran = waited + int(timing.inference_ms * 1e6)
        attributes = {
            "raystream.batch_size": timing.batch_size,
            "raystream.engine_ms": timing.inference_ms,
        }
        if timing.gpu_ms:  # a GPU engine's pass, timed with CUDA events
            attributes["raystream.gpu_ms"] = timing.gpu_ms
        self._child("raystream.engine", waited, ran, attributes)

    def passed_on(self, batch: Batch) -> Batch:
        """`batch` as this group hands it on: its traced jobs carry this group's spans, so
        the next group's spans hang under them."""
        if not self._spans:
            return batch
        jobs = list(batch.jobs)
        for index, span in self._spans.items():
            jobs[index] = copied(jobs[index], trace=traceparent(span))
        return batch.replace(jobs=tuple(jobs))

    def end(self, failed: BaseException | None = None) -> None:
        for span in self._spans.values():
            if failed is not None:
                span.set_status(Status(StatusCode.ERROR, str(failed)))
            span.end()


def start_stage(batch: Batch, attributes: dict[str, object]) -> StageTrace | None:
    """The spans of `batch` in this stage group; None where tracing is off here or none of
    its requests is traced."""
    if _tracer is None or not any(job.trace for job in batch.jobs):
        return None
    return StageTrace(batch, attributes)
