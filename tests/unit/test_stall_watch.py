"""StallWatch: how long the oldest call still running has run (the health check's input)."""

from __future__ import annotations

import threading

import pytest

from serve_app.stages.stall_watch import StallWatch


def test_it_reports_the_oldest_call_running_and_zero_once_none_runs() -> None:
    now = [100.0]  # the watch's clock, moved by the test
    watch = StallWatch(clock=lambda: now[0])
    assert watch.stalled_s() == 0.0
    release = threading.Event()

    def call(started: threading.Event) -> None:
        started.set()
        assert release.wait(10)

    first_started, second_started = threading.Event(), threading.Event()
    first = threading.Thread(target=watch.run, args=(call, first_started))
    first.start()
    assert first_started.wait(10)
    now[0] += 5.0
    second = threading.Thread(target=watch.run, args=(call, second_started))
    second.start()
    assert second_started.wait(10)
    now[0] += 1.0
    assert watch.stalled_s() == 6.0  # the first call's age, not the second's
    release.set()
    first.join()
    second.join()
    assert watch.stalled_s() == 0.0


def test_a_call_that_raises_is_no_longer_watched() -> None:
    watch = StallWatch()

    def fails():
        raise ValueError("engine error")

    with pytest.raises(ValueError):
        watch.run(fails)
    assert watch.stalled_s() == 0.0
    assert watch.run(lambda x: x + 1, 1) == 2
