"""How long the GPU or engine work running now has run. A replica's health check
(StageGroup.check_health) fails once a call has run past ENGINE_STALL_TIMEOUT_S
(serve_app/tuning.py): the engine or the JPEG decoder is stuck (a hung GPU or runtime), and
Serve replaces it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


class StallWatch:
    """`run(call, *args)` on a worker thread notes when the call started until it returns;
    `stalled_s()`, from any thread, says how long the oldest call still running has run."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # tests set it
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}  # worker thread -> when its call started

    def run(self, call: Callable[..., R], *args) -> R:
        thread = threading.get_ident()
        with self._lock:
            self._started[thread] = self._clock()
        try:
            return call(*args)
        finally:
            with self._lock:
                del self._started[thread]

    def stalled_s(self) -> float:
        with self._lock:
            oldest = min(self._started.values(), default=None)
        return 0.0 if oldest is None else self._clock() - oldest
