"""IngressMetrics gathers counts between exports; what it hands Ray must be valid."""

from __future__ import annotations

from serve_app.observability.metrics import IngressMetrics


def test_flush_hands_ray_only_positive_increments(monkeypatch) -> None:
    # Ray refuses an increment of 0: a stage that took 0 ms (no decode for pixels) once made
    # flush() raise every second. Each counter call is recorded here, then handed to Ray's
    # own inc (which validates it; outside a Ray worker the value is then discarded).
    metrics = IngressMetrics()
    handed: list[tuple[str, float, dict[str, str]]] = []
    for name in ("requests", "images", "rejected", "stages"):
        counter = getattr(metrics, name)

        def inc(value, tags=None, _name=name, _real=counter.inc) -> None:
            handed.append((_name, value, tags))
            _real(value, tags=tags)

        monkeypatch.setattr(counter, "inc", inc)
    stages = {"queue": 0.0, "preprocess": 0.0, "compute": 1.5, "postprocess": 0.2}
    metrics.record("OK", {"OK": 7, "INVALID_ARGUMENT": 1}, 3.0, stages)
    metrics.record("OK", {"OK": 2}, 2.0, {"compute": 0.5})
    metrics.record("RESOURCE_EXHAUSTED", {}, 0.1, {})
    assert handed == []  # gathered, not handed over one by one
    metrics.flush()
    assert all(value > 0 for _, value, _ in handed)
    assert sorted(handed, key=repr) == sorted(
        [
            ("requests", 2, {"code": "OK"}),
            ("requests", 1, {"code": "RESOURCE_EXHAUSTED"}),
            ("rejected", 1, {"code": "RESOURCE_EXHAUSTED"}),  # refused before running
            ("images", 9, {"code": "OK"}),
            ("images", 1, {"code": "INVALID_ARGUMENT"}),
            ("stages", 2.0, {"stage": "compute"}),
            ("stages", 0.2, {"stage": "postprocess"}),  # no queue or preprocess: 0 ms
        ],
        key=repr,
    )
    handed.clear()
    metrics.flush()
    assert handed == []  # nothing gathered: nothing to hand over


def test_the_result_cache_counts_reach_ray_at_a_flush(monkeypatch) -> None:
    metrics = IngressMetrics()
    handed: list[tuple[str, float, dict[str, str] | None]] = []
    for name in ("cache_images", "cache_evictions"):
        counter = getattr(metrics, name)

        def inc(value, tags=None, _name=name, _real=counter.inc) -> None:
            handed.append((_name, value, tags))
            _real(value, tags=tags)

        monkeypatch.setattr(counter, "inc", inc)
    metrics.record_cache({"hit": 5, "miss": 3, "shared": 0}, 2, size=4096, entries=3)
    metrics.record_cache({"hit": 1}, 0, size=4096, entries=3)
    assert handed == []
    metrics.flush()
    assert sorted(handed, key=repr) == sorted(
        [
            ("cache_images", 6, {"result": "hit"}),
            ("cache_images", 3, {"result": "miss"}),
            ("cache_evictions", 2, None),
        ],
        key=repr,
    )


def test_a_request_of_no_images_reaches_ray_as_a_request_alone(monkeypatch) -> None:
    metrics = IngressMetrics()
    handed: list[tuple[str, float]] = []
    for name in ("requests", "images"):
        counter = getattr(metrics, name)

        def inc(value, tags=None, _name=name, _real=counter.inc) -> None:
            handed.append((_name, value))
            _real(value, tags=tags)  # Ray's own check: it raised on the 0 before

        monkeypatch.setattr(counter, "inc", inc)
    metrics.record("OK", {"OK": 0}, 1.0, {})
    metrics.flush()
    assert handed == [("requests", 1)]
