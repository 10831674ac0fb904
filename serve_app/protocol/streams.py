"""One stream, whichever protocol (raystream.v1 `Classify`, OIP `ModelStreamInfer`): read with
backpressure, answer requests concurrently, yield answers in completion order, drain on
shutdown. No grpc here: the ingress turns a drained stream into its UNAVAILABLE status.

Memory per stream is bounded whatever the client does: a request holds its slot (one of
`max_in_flight`) and its bytes (out of `max_buffered_bytes`) until its answer has been handed
to gRPC, not merely computed. gRPC's send waits while the client's HTTP/2 window is full, so a
client that stops reading stops the stream from reading too, and what the server holds for it
stays under those two numbers (plus the one request read past the byte budget).
"""

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
    def __init__(self, max_in_flight: int, max_buffered_bytes: int = 1 << 62) -> None:
        self._max_in_flight = max_in_flight
        self._max_buffered_bytes = max_buffered_bytes
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
        start: Callable[[Request, Callable[[Answer], None]], None],
        key: Callable[[Request], str] | None = None,
        duplicate: Callable[[Request], Answer] | None = None,
        size: Callable[[Request], int] = lambda request: 0,
    ) -> AsyncIterator[Answer]:
        """`start(request, reply)` begins answering a request; `reply(answer)` must then be
        called once, from the event loop. At most `max_in_flight` requests, holding at most
        `max_buffered_bytes` (by `size`), are read and not yet answered; past either the
        stream is not read and gRPC flow control pushes back. A request whose `key` is
        being answered gets `duplicate(request)` instead."""
        answers: asyncio.Queue = asyncio.Queue()  # (answer, its request's size)
        slots = asyncio.Semaphore(self._max_in_flight)
        buffered = 0  # bytes of the requests read and not yet answered
        room = asyncio.Event()  # set while buffered < max_buffered_bytes
        room.set()
        computing: set[str] = set()
        unanswered = 0  # read and not yet yielded

        def reply_for(request_key: str, request_size: int) -> Callable[[Answer], None]:
            def reply(answer: Answer) -> None:
                computing.discard(request_key)
                answers.put_nowait((answer, request_size))

            return reply

        async def read() -> None:
            nonlocal unanswered, buffered
            iterator = aiter(requests)
            try:
                while True:
                    # A slot and room before the next read, so a drain that cancels this
                    # task never drops a request already read.
                    await slots.acquire()
                    await room.wait()
                    try:
                        request = await anext(iterator)
                    except StopAsyncIteration:
                        break
                    unanswered += 1
                    request_size = size(request)
                    buffered += request_size
                    if buffered >= self._max_buffered_bytes:
                        room.clear()
                    request_key = key(request) if key is not None else ""
                    if request_key and request_key in computing and duplicate is not None:
                        answers.put_nowait((duplicate(request), request_size))
                        continue
                    if request_key:
                        computing.add(request_key)
                    try:
                        start(request, reply_for(request_key, request_size))
                    except Exception as exc:  # a bug in `start`: the stream ends with it
                        answers.put_nowait((_Failed(exc), request_size))
            except asyncio.CancelledError:
                if not self.draining:
                    raise
            finally:
                answers.put_nowait((_END, 0))

        reader = asyncio.create_task(read())
        self._readers.add(reader)
        try:
            reading = True
            while reading or unanswered:
                item, item_size = await answers.get()
                if item is _END:
                    reading = False
                    continue
                unanswered -= 1
                if isinstance(item, _Failed):
                    raise item.error
                yield item  # returns once gRPC has taken the answer (the client reads)
                slots.release()
                buffered -= item_size
                if buffered < self._max_buffered_bytes:
                    room.set()
            reader.result()  # re-raise a transport failure while reading
        finally:
            self._readers.discard(reader)
            reader.cancel()


class TaskStarter:
    """A `start` for StreamRunner.run from a coroutine function (the slower protocols): a
    task per request. `cancel()` once the stream has ended: its requests still running are
    abandoned (their work skipped, their in-flight slots given back), as v1's stream does."""

    def __init__(self, answer: Callable[[Request], Awaitable[Answer]]) -> None:
        self._answer = answer
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, request: Request, reply: Callable[[Answer], None]) -> None:
        task = asyncio.ensure_future(self._answer(request))
        self._tasks.add(task)

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled():
                reply(task.result() if task.exception() is None else _Failed(task.exception()))

        task.add_done_callback(done)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
