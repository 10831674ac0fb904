"""IngressMetrics gathers counts between exports; what it hands Ray must be valid."""

from __future__ import annotations

from serve_app.metrics import IngressMetrics


def test_flush_hands_ray_only_positive_increments() -> None:
    # Outside a Ray worker the metrics are discarded, but Ray still validates each call:
    # a stage that took 0 ms (no decode for pixels) once made flush() raise every second.
    metrics = IngressMetrics()
    stages = {"queue": 0.0, "preprocess": 0.0, "compute": 1.5, "postprocess": 0.2}
    metrics.record("OK", {"OK": 7, "INVALID_ARGUMENT": 1}, 3.0, stages)
    metrics.record("RESOURCE_EXHAUSTED", {}, 0.1, {})
    metrics.flush()
    metrics.flush()  # nothing gathered: nothing to hand over
