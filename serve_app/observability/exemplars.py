"""Latency histograms whose buckets carry trace ids as exemplars, so a slow bucket links to a
trace of a request that fell in it.

Ray's metrics (serve_app/observability/metrics.py) cannot carry exemplars. With tracing on,
the ingress records its request latency a second time, in an OpenTelemetry histogram of the
same name and buckets, with the request's span as the context: the SDK's trace-based filter
keeps an exemplar (trace id, span id, value) only for sampled requests, the last one in each
bucket of an export interval. The histograms go over OTLP gRPC to the collector that takes
the traces, which serves them to Prometheus with their exemplars (docs/operations.md#traces).

Tracing off, `configure` is never called: no MeterProvider, and `histogram` returns None.
On, the MeterProvider comes with the first histogram: processes that record none (the
stage replicas) have none.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import Span

logger = logging.getLogger(__name__)

_settings: tuple[str, float, Resource] | None = None  # set by configure: tracing is on
_meter = None  # the Meter, made with the first histogram (stage replicas record none)
_provider = None
_EMPTY = Context()  # an unsampled request's context: no span, so no exemplar


def configure(endpoint: str, interval_s: float, resource: Resource) -> None:
    """Tracing is on here: the histograms go every `interval_s` to the OTLP gRPC collector
    at `endpoint`, only sampled requests' spans as exemplars."""
    global _settings
    _settings = (endpoint, interval_s, resource)


def _start_meter() -> None:
    global _meter, _provider
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider, TraceBasedExemplarFilter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    endpoint, interval_s, resource = _settings
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint, insecure=True),
        export_interval_millis=interval_s * 1000,
    )
    _provider = MeterProvider(
        metric_readers=[reader], resource=resource, exemplar_filter=TraceBasedExemplarFilter()
    )
    _meter = _provider.get_meter("raystream")


class ExemplarHistogram:
    """A latency histogram recorded with the request's span, for its exemplar. An
    explicit-bucket histogram keeps the last exemplar of each bucket per export (the SDK's
    AlignedHistogramBucketExemplarReservoir)."""

    def __init__(self, name: str, boundaries: Sequence[float], description: str) -> None:
        self._histogram = _meter.create_histogram(
            name, description=description, explicit_bucket_boundaries_advisory=boundaries
        )

    def record(self, ms: float, span: Span | None) -> None:
        """One request's `ms`; `span`: its span where it is traced (an exemplar), else None."""
        context = _EMPTY if span is None else trace.set_span_in_context(span, _EMPTY)
        self._histogram.record(ms, context=context)


def histogram(name: str, boundaries: Sequence[float], description: str) -> ExemplarHistogram | None:
    """The exemplar twin of the Ray histogram `name` (the same `boundaries`); None where
    tracing is off in this process."""
    if _settings is None:
        return None
    if _meter is None:
        _start_meter()
    return ExemplarHistogram(name, boundaries, description)


def flush(timeout_s: float = 5.0) -> bool:
    """Export the histograms now (a replica stopping; tests)."""
    return _provider is None or _provider.force_flush(int(timeout_s * 1000))
