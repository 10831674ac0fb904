"""A dynamic batcher that forms a batch when the engine can take it (Triton's semantics).

Ray Serve's `@serve.batch` forms the next batch as soon as one request is queued and only
then waits for a free concurrency slot, so while the engine is busy requests pile up in
already-formed one-request batches (measured under load: a mean batch of 8 images, one
request, after 590 ms of queueing). Here each of `max_concurrent` workers takes requests
from the queue only when it is free: under load a batch holds everything that arrived while
the engine was busy (up to `max_batch_size` images), at low load a lone request runs at once,
and `max_delay_s` optionally waits for company. Cancelled requests, and requests whose
deadline passed while queued (`DeadlineExceeded`), are dropped before they reach the engine;
a full queue rejects at once (`Overloaded`). Closing (its model version unloaded) fails
every request still queued or in a running batch (`Unavailable`): none waits for good.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from serve_app.errors import DeadlineExceeded, Overloaded, Unavailable

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T, R]):
    item: T
    size: int
    future: asyncio.Future[R]
    deadline: float | None = None  # time.time() past which nobody waits for the result
    enqueued: float = field(default_factory=time.perf_counter)
    taken: bool = False  # out of the queue (into a batch, or dropped)


class DynamicBatcher(Generic[T, R]):
    def __init__(
        self,
        run: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        size_of: Callable[[T], int],
        *,
        max_batch_size: int,
        max_delay_s: float = 0.0,
        max_concurrent: int = 1,
        max_queued: int = 4096,
    ) -> None:
        self._run, self._size_of = run, size_of
        self.max_batch_size, self.max_delay_s = max_batch_size, max_delay_s
        self.max_queued = max_queued  # images waiting; past this, submit() raises Overloaded
        self._running = 0  # workers running a batch
        self._queue: collections.deque[_Pending[T, R]] = collections.deque()
        self._queued_images = 0
        self._arrived = asyncio.Event()
        # `concurrency` batches run at once, at most `max_concurrent`; it may change at run
        # time (the replica's user_config): workers past it idle.
        self.concurrency = max_concurrent
        self._workers = [asyncio.create_task(self._work(i)) for i in range(max_concurrent)]
        self._closed = False

    @property
    def queued_images(self) -> int:
        return self._queued_images

    def room(self) -> int:
        """Images the queue takes before submit() refuses."""
        return self.max_queued - self._queued_images

    async def submit(self, item: T, deadline: float | None = None) -> tuple[R, float]:
        """Run `item` in some batch; returns its result and the ms it waited in the queue.
        Past `deadline` (a time.time() value) it is dropped: DeadlineExceeded."""
        size = self._size_of(item)
        if self._closed:
            raise _closed()
        if self._queued_images + size > self.max_queued:
            raise Overloaded(
                f"inference queue is full ({self._queued_images} images waiting, "
                f"limit {self.max_queued}); retry later"
            )
        pending = _Pending(item, size, asyncio.get_running_loop().create_future(), deadline)
        self._queue.append(pending)
        self._queued_images += size
        self._arrived.set()
        try:
            result = await pending.future
        except asyncio.CancelledError:
            if not pending.taken:  # still queued: its images no longer count as waiting
                self._queued_images -= pending.size
                pending.size = 0
            raise
        return result, (time.perf_counter() - pending.enqueued) * 1000.0

    def _take(self) -> list[_Pending[T, R]]:
        batch, images, now = [], 0, time.time()
        while self._queue:
            head = self._queue[0]
            expired = head.deadline is not None and head.deadline <= now
            if head.future.done() or expired:  # cancelled or expired: never reaches the engine
                self._queue.popleft()
                head.taken = True
                self._queued_images -= head.size
                if not head.future.done():
                    waited = (time.perf_counter() - head.enqueued) * 1000.0
                    message = f"deadline passed after {waited:.0f} ms in the batch queue"
                    head.future.set_exception(DeadlineExceeded(message))
                continue
            if batch and images + head.size > self.max_batch_size:
                break
            batch.append(self._queue.popleft())
            head.taken = True
            self._queued_images -= head.size
            images += head.size
        return batch

    def set_concurrency(self, batches: int) -> None:
        if not 1 <= batches <= len(self._workers):
            raise ValueError(
                f"concurrent batches must be in 1..{len(self._workers)}, got {batches}"
            )
        self.concurrency = batches
        self._arrived.set()  # wake the workers it enables

    async def _work(self, index: int) -> None:
        while True:
            while not self._queue or index >= self.concurrency:
                self._arrived.clear()
                await self._arrived.wait()
            if self.max_delay_s > 0:
                first = self._queue[0].enqueued
                while (
                    self._queued_images < self.max_batch_size
                    and time.perf_counter() - first < self.max_delay_s
                ):
                    self._arrived.clear()
                    remaining = self.max_delay_s - (time.perf_counter() - first)
                    try:
                        await asyncio.wait_for(self._arrived.wait(), max(remaining, 0))
                    except asyncio.TimeoutError:
                        break
            batch = self._take()
            if not batch:
                continue
            self._running += 1
            try:
                await self._run_batch(batch)
            finally:
                self._running -= 1

    async def _run_batch(self, batch: list[_Pending[T, R]]) -> None:
        try:
            results = await self._run([p.item for p in batch])
        except asyncio.CancelledError:  # closed while it ran
            _fail(batch, _closed())
            raise
        except Exception as exc:
            _fail(batch, exc)
            return
        for p, result in zip(batch, results, strict=True):
            if not p.future.done():
                p.future.set_result(result)

    async def close(self) -> None:
        """Stop the workers; the requests still queued or running fail (Unavailable)."""
        self.abandon()
        await asyncio.gather(*self._workers, return_exceptions=True)
        # Each stopped worker's CancelledError holds its frame, which holds this batcher:
        # a cycle through the engine that only the cyclic collector would free.
        self._workers = []

    def abandon(self) -> None:
        """close() without waiting for the workers to stop: for a stage given up while its
        thread may be stuck (a warm-up past its load timeout, LOAD_TIMEOUT_S)."""
        self._closed = True
        for worker in self._workers:
            worker.cancel()
        _fail(self._queue, _closed())
        self._queue.clear()
        self._queued_images = 0


def _fail(pending: Iterable[_Pending], exc: BaseException) -> None:
    for p in pending:
        if not p.future.done():
            p.future.set_exception(exc)


def _closed() -> Unavailable:
    return Unavailable("the model version was unloaded before this request's batch was done")
