"""Exemplars cost nothing with tracing off: no MeterProvider, nothing sent to a collector."""

from __future__ import annotations

import asyncio

from support import OtlpReceiver

from serve_app.config import TracingConfig
from serve_app.observability import exemplars, tracing
from serve_app.observability.metrics import IngressMetrics


async def test_tracing_off_makes_no_exemplar_histogram_and_exports_nothing() -> None:
    receiver = await OtlpReceiver().start()
    try:
        config = TracingConfig(otlp_endpoint=None, sample_ratio=1.0)  # off
        tracing.configure(config, "Ingress")
        metrics = IngressMetrics()
        assert metrics.total_exemplars is None
        metrics.record("OK", {"OK": 1}, 3.0, {"compute": 1.0})
        # flushed on a thread: the receiver answers on this loop
        assert await asyncio.to_thread(tracing.flush)
        assert exemplars._provider is None  # no MeterProvider, so no export thread either
        assert receiver.points == [] and receiver.spans == []
    finally:
        await receiver.stop()
