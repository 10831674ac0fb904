"""StallWatch: how long the oldest call still running has run (the health check's input)."""

from __future__ import annotations

import threading
import time

import pytest

from serve_app.stages.stall_watch import StallWatch


def test_it_reports_the_oldest_call_running_and_zero_once_none_runs() -> None:
    watch = StallWatch()
    assert watch.stalled_s() == 0.0
    release = threading.Event()
    first = threading.Thread(target=watch.run, args=(release.wait,))
    first.start()
    time.sleep(0.2)
    second = threading.Thread(target=watch.run, args=(release.wait,))
    second.start()
    time.sleep(0.05)
    assert watch.stalled_s() >= 0.2  # the first call's age, not the second's
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
