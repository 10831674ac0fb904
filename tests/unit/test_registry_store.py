"""The registry's store (serve_app/models/registry.py MemoryStore): reports that expire on the
store's own clock, changes counted for the watches; no Ray."""

from __future__ import annotations

from serve_app.models.registry import MemoryStore, ModelRegistry
from serve_app.tuning import FRESH_S


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_report_lives_while_it_is_renewed_and_goes_fresh_s_after_the_last() -> None:
    clock = Clock()
    registry = ModelRegistry(MemoryStore(clock), "app")
    registry.report("Inference", "r1", ["m/1"], address="10.0.0.1:9100")
    registry.report("Inference", "r2", ["m/1"])
    for _ in range(10):  # r1 renews its report, r2 has stopped
        clock.now += FRESH_S / 2
        registry.report("Inference", "r1", ["m/1"], address="10.0.0.1:9100")
    assert [report.replica for report in registry.reports("Inference")] == ["r1"]
    assert registry.ports("Inference") == {"10.0.0.1:9100": frozenset({"m/1"})}
    clock.now += FRESH_S * 1.01
    assert registry.reports("Inference") == [] and registry.ports("Inference") == {}


def test_reports_carry_no_time_so_no_two_clocks_are_compared() -> None:
    """A replica whose host's clock is a minute off reports the same bytes as any other:
    freshness is the store's alone."""
    store = MemoryStore(Clock())
    registry = ModelRegistry(store, "app")
    registry.report("Inference", "skewed", ["m/1"])
    (key,) = store.keys("app/report/")
    assert store.get(key) == b'{"holds": ["m/1"], "failed": {}}'


def test_a_replica_that_leaves_is_gone_at_once_and_the_desired_state_stays() -> None:
    store = MemoryStore(Clock())
    registry = ModelRegistry(store, "app")
    assert registry.start(["m/1"]) == {"m/1": "serve"}
    registry.report("Preprocess", "r1", ["m/1"])
    registry.leave("Preprocess", "r1")
    assert registry.reports("Preprocess") == []
    assert store.keys("app/report/") == [] and registry.desired() == {"m/1": "serve"}


def test_only_changes_count_as_versions_a_renewal_does_not() -> None:
    """Watches return on a new version: an unchanged report renewed every second must not
    wake every replica's watch."""
    clock = Clock()
    store = MemoryStore(clock)
    registry = ModelRegistry(store, "app")
    registry.report("Inference", "r1", ["m/1"])
    version = store.version
    for _ in range(5):
        clock.now += 1
        registry.report("Inference", "r1", ["m/1"])
    assert store.version == version
    registry.report("Inference", "r1", ["m/1", "m/2"])
    assert store.version == version + 1
    clock.now += FRESH_S + 1
    assert store.expire() and store.version == version + 2
