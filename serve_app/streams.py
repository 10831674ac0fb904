"""One stream, whichever protocol (raystream.v1 `Classify`, OIP `ModelStreamInfer`): read with
backpressure, answer requests concurrently, yield answers in completion order, drain on
shutdown. No grpc here: the ingress turns a drained stream into its UNAVAILABLE status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Request = TypeVar("Request")
Answer = TypeVar("Answer")
_END = object()


class _Failed:
    def __init__(self, error: Exception) -> None:
        self.error = error


class StreamRunner:
    def __init__(self, max_in_flight_per_stream: int) -> None:
        self._max_in_flight = max_in_flight_per_stream
        self.draining = False
        self._readers: set[asyncio.Task] = set()  # one per open stream

    def drain(self) -> None:
        """Every stream stops reading; what was read is still answered."""
        self.draining = True
        for reader in self._readers:
            reader.cancel()

    async def run(
        self,
        requests: AsyncIterator[Request],
        answer: Callable[[Request], Awaitable[Answer]],
        key: Callable[[Request], str] | None = None,
        duplicate: Callable[[Request], Answer] | None = None,
    ) -> AsyncIterator[Answer]:
        """At most `max_in_flight_per_stream` requests run at once (past it, the stream is
        not read: gRPC flow control pushes back). A request whose `key` is already in flight
        gets `duplicate(request)` instead of running."""
        answers: asyncio.Queue = asyncio.Queue()
        slots = asyncio.Semaphore(self._max_in_flight)
        in_flight: set[str] = set()
        tasks: set[asyncio.Task] = set()
        unanswered = 0  # read and not yet yielded: counted here, not by task done-callbacks,
        # which run a loop step after the answer is queued and would leave this loop waiting

        async def run_one(request: Request, request_key: str) -> None:
            try:
                result = await answer(request)
            except Exception as exc:  # a bug in `answer`: the stream ends with it
                result = _Failed(exc)
            finally:
                slots.release()
                in_flight.discard(request_key)
            answers.put_nowait(result)

        async def read() -> None:
            nonlocal unanswered
            iterator = aiter(requests)
            try:
                while True:
                    # A slot before the next read, so a drain that cancels this task never
                    # drops a request already read.
                    await slots.acquire()
                    try:
                        request = await anext(iterator)
                    except StopAsyncIteration:
                        break
                    unanswered += 1
                    request_key = key(request) if key is not None else ""
                    if request_key and request_key in in_flight and duplicate is not None:
                        slots.release()
                        answers.put_nowait(duplicate(request))
                        continue
                    if request_key:
                        in_flight.add(request_key)
                    task = asyncio.create_task(run_one(request, request_key))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            except asyncio.CancelledError:
                if not self.draining:
                    raise
            finally:
                answers.put_nowait(_END)

        reader = asyncio.create_task(read())
        self._readers.add(reader)
        try:
            reading = True
            while reading or unanswered:
                item = await answers.get()
                if item is _END:
                    reading = False
                    continue
                unanswered -= 1
                if isinstance(item, _Failed):
                    raise item.error
                yield item
            reader.result()  # re-raise a transport failure while reading
        finally:
            self._readers.discard(reader)
            reader.cancel()
            for task in tasks:
                task.cancel()
