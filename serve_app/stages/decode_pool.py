"""The CPU decode pool: decode threads shared fairly between streams, whatever their images cost.

A plain thread pool runs jobs in arrival order, so one client's expensive images (a request of
32 large 16-bit PNGs is half a minute of CPU) delay every other client's photos for as long.
Here:
- Each image is a job, queued under its request's *flow* (the stream it came on, or the
  connection of a unary call). Threads take jobs from the flows in turn, and a flow with
  nothing queued goes first, so one photo waits for the images being decoded, not for the
  queues of other flows.
- An image's cost is the pixels its decoder will produce (a JPEG's after DCT scaling), read
  from its header before decoding. Images over HEAVY_PIXELS are heavy: at most
  `threads - 1` threads decode heavy images at once, so one thread is always free for cheap
  ones. Heavy images wait in a fair queue of their own.
- A request may decode at most `max_request_pixels`; its images past the budget fail alone.
- Images of a request whose deadline passed, or whose caller stopped waiting, are skipped.

Results go back to the event loop once per request, not once per image.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from engines.images import DecodeLimits, InvalidImage
from serve_app.config import AppConfig
from serve_app.errors import DeadlineExceeded
from serve_app.tuning import HEAVY_PIXELS


def decode_limits(config: AppConfig) -> DecodeLimits:
    """The config's limits on one image, as the decoders take them (CPU and nvJPEG)."""
    return DecodeLimits(config.limits.max_image_bytes, config.limits.max_image_pixels)


logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    flow: Hashable
    images: list[bytes]
    deadline: float | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    results: list = field(default_factory=list)
    remaining: int = 0
    pixels_left: int = 0  # of max_request_pixels
    failed: BaseException | None = None  # the request as a whole (its deadline passed)

    @property
    def abandoned(self) -> bool:
        return self.failed is not None or self.future.done()  # done: cancelled by its caller


@dataclass(frozen=True, eq=False)
class _Job:
    request: _Request
    index: int


class _FairQueue:
    """Jobs by flow, taken one per flow in turn. As in FQ-CoDel, a flow that had nothing
    queued goes before the flows that keep a backlog, so a stream sending one photo now and
    then waits for no backlog at all."""

    def __init__(self) -> None:
        self._new: dict[Hashable, collections.deque[_Job]] = {}  # in arrival order
        self._old: collections.OrderedDict[Hashable, collections.deque[_Job]] = (
            collections.OrderedDict()
        )

    def __bool__(self) -> bool:
        return bool(self._new or self._old)

    def push(self, job: _Job) -> None:
        flow = job.request.flow
        jobs = self._new.get(flow)
        if jobs is None:
            jobs = self._old.get(flow)
        if jobs is None:
            jobs = self._new[flow] = collections.deque()
        jobs.append(job)

    def pop(self) -> _Job:
        flows = self._new or self._old
        flow = next(iter(flows))
        jobs = flows.pop(flow)
        job = jobs.popleft()
        if jobs:
            self._old[flow] = jobs  # at the end: its turn is over
        return job


class DecodePool:
    """`run(images, flow, deadline)` -> one result per image, in order: whatever `decode`
    returns for it, or the InvalidImage that it or the pixel budget raised.

    `cost(data)` reads an image's header and returns the pixels decoding it will produce
    (raising InvalidImage for a bad header); `decode(data)` decodes it."""

    def __init__(
        self,
        threads: int,
        cost: Callable[[bytes], int],
        decode: Callable[[bytes], object],
        max_request_pixels: int,
    ) -> None:
        self._cost, self._decode = cost, decode
        self._max_request_pixels = max_request_pixels
        self._heavy_slots = max(threads - 1, 1)
        self._heavy_running = 0
        self._fresh = _FairQueue()  # images whose cost is not known yet
        self._heavy = _FairQueue()  # heavy images waiting for a heavy slot
        self._ready = threading.Condition()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"decode-{i}", daemon=True).start()

    async def run(
        self,
        images: list[bytes],
        flow: Hashable,
        deadline: float | None = None,
        pixels_spent: int = 0,
    ) -> list[object | InvalidImage]:
        """`pixels_spent`: of the request's pixel budget, by images decoded elsewhere."""
        loop = asyncio.get_running_loop()
        request = _Request(flow, images, deadline, loop, loop.create_future())
        request.results = [None] * len(images)
        request.remaining = len(images)
        request.pixels_left = self._max_request_pixels - pixels_spent
        if not images:
            return []
        with self._ready:
            for index in range(len(images)):
                self._fresh.push(_Job(request, index))
            self._ready.notify(len(images))
        return await request.future  # cancelling it makes the threads skip what is left

    # -- the decode threads ---------------------------------------------------------------

    def _next(self) -> tuple[_Job, bool]:
        """The next job, and whether it holds a heavy slot already (a heavy image's second
        turn). Waits while there is nothing this thread may take."""
        with self._ready:
            while True:
                if self._heavy and self._heavy_running < self._heavy_slots:
                    self._heavy_running += 1
                    return self._heavy.pop(), True
                if self._fresh:
                    return self._fresh.pop(), False
                self._ready.wait()

    def _work(self) -> None:
        while True:
            job, holds_slot = self._next()
            try:
                self._run(job, holds_slot)
            finally:
                if holds_slot:
                    self._release_heavy_slot()

    def _release_heavy_slot(self) -> None:
        with self._ready:
            self._heavy_running -= 1
            if self._heavy:
                self._ready.notify()

    def _run(self, job: _Job, holds_slot: bool) -> None:
        request = job.request
        if request.abandoned:
            return self._done(job, None)
        if request.deadline is not None and time.time() >= request.deadline:
            request.failed = DeadlineExceeded("deadline passed before decoding")
            return self._done(job, None)
        data = request.images[job.index]
        if not holds_slot:  # first turn: read the header, charge the budget, maybe defer
            try:
                cost = self._cost(data)
            except Exception as exc:  # see _decode_one
                return self._done(job, _image_failure(exc))
            with self._ready:
                if cost > request.pixels_left:
                    result = InvalidImage(
                        f"decoding this image ({cost} pixels) would take the request past its "
                        f"budget of {self._max_request_pixels} decoded pixels "
                        f"(MAX_REQUEST_PIXELS); send it in another request"
                    )
                    return self._done(job, result, locked=True)
                request.pixels_left -= cost
                if cost > HEAVY_PIXELS:
                    if self._heavy_running >= self._heavy_slots:
                        self._heavy.push(job)  # decoded when a heavy slot frees
                        return None
                    self._heavy_running += 1
                    holds_slot = True
            if holds_slot:
                try:
                    return self._decode_one(job)
                finally:
                    self._release_heavy_slot()
        return self._decode_one(job)

    def _decode_one(self, job: _Job) -> None:
        # Whatever a decoder raises fails that image alone: an exception out of this thread
        # would end it and leave the request waiting for an answer for good.
        try:
            result = self._decode(job.request.images[job.index])
        except Exception as exc:
            result = _image_failure(exc)
        self._done(job, result)

    def _done(self, job: _Job, result: object, locked: bool = False) -> None:
        """Record one image's result; the request's last one wakes its caller."""
        request = job.request
        if not locked:
            self._ready.acquire()
        try:
            request.results[job.index] = result
            request.remaining -= 1
            last = request.remaining == 0
        finally:
            if not locked:
                self._ready.release()
        if last:
            request.loop.call_soon_threadsafe(_resolve, request)


def _image_failure(exc: Exception) -> InvalidImage:
    """An image's failure: its InvalidImage, or one for what the decoder raised unexpectedly
    (a PIL plugin's struct.error, a MemoryError: logged, as it may be a bug)."""
    if isinstance(exc, InvalidImage):
        return exc
    logger.warning("decoding an image raised %s", type(exc).__name__, exc_info=exc)
    return InvalidImage(f"cannot decode this image: {type(exc).__name__}: {exc}")


def _resolve(request: _Request) -> None:
    if request.future.done():  # its caller stopped waiting
        return
    if request.failed is not None:
        request.future.set_exception(request.failed)
    else:
        request.future.set_result(request.results)
