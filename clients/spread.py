"""One logical bidi stream over one or several connections (`Client`, clients/client.py).

Topology `direct` serves each connection in the one ingress replica the kernel hashed it
to, so a client with one long-lived stream reaches one replica. Spreading that stream's
requests over streams on connections to different replicas reaches all of them, with the
same contract as one stream: every request gets exactly one response. Over one connection
or several, a stream whose replica goes away carries on over a new connection.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from raystream.v1 import classifier_pb2 as pb

Requests = AsyncIterable[pb.ClassifyRequest] | Iterable[pb.ClassifyRequest]
# One connection's stream: requests in, responses out (Client._stream_on on one channel).
StreamFn = Callable[[AsyncIterable[pb.ClassifyRequest]], AsyncIterator[pb.ClassifyResponse]]
# A stream on a new connection in place of connection i, whose stream failed; the flag says
# whether that connection ever had a request answered OK (then it is worth waiting for a
# server to come back; a server that never answered is likely not running at all).
Reopen = Callable[[int, bool], Awaitable[StreamFn]]

# Failures after which a lane opens a new connection: a replica going away (drained,
# restarted, redeployed) ends its streams with UNAVAILABLE, and grpcio's aio client can
# report that as INTERNAL "Internal error from Core" when a write races it (grpc/grpc#36066).
REOPEN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL})
MAX_REOPENS = 3  # in a row, with no request answered OK in between

# The message of each request a failed stream answers for itself (clients/client.py).
STREAM_ENDED = "the stream ended before this request was answered"

_LANE_DONE = object()
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_REOPEN_CODES = frozenset(code.value[0] for code in REOPEN_CODES)


def _may_resend(error: pb.Error) -> bool:
    """A request answered UNAVAILABLE (its replica is going away), or left unanswered by a
    stream that failed with one of REOPEN_CODES, was not classified and may go again. A
    server's own INTERNAL answer is that request's failure: sending it again would only
    repeat it."""
    if error.code == _UNAVAILABLE:
        return True
    return error.code in _REOPEN_CODES and error.message.startswith(STREAM_ENDED)


def _reconnect_failure(
    ended: grpc.aio.AioRpcError, dial: grpc.aio.AioRpcError
) -> grpc.aio.AioRpcError:
    """The failure of a stream that ended and could not reconnect. A server that answered
    the dial said why (UNAUTHENTICATED, say): that is the failure. Otherwise no server is in
    reach: UNAVAILABLE, whatever code ended the stream (grpcio reports a server's shutdown
    as INTERNAL at times, grpc/grpc#36066) and whether the dial was refused or timed out
    waiting (DEADLINE_EXCEEDED)."""
    if dial.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return dial
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        ended.initial_metadata(),
        ended.trailing_metadata(),
        f"{ended.details()}; reconnecting failed: {dial.code().name} {dial.details()}",
    )


async def as_async(items: AsyncIterable[Any] | Iterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def error_response(request_id: str, code: grpc.StatusCode, message: str) -> pb.ClassifyResponse:
    """The response of a request that a failed stream can no longer answer."""
    return pb.ClassifyResponse(
        request_id=request_id, error=pb.Error(code=code.value[0], message=message)
    )


class _Lane:
    """One connection's share of the spread stream."""

    def __init__(self, stream: StreamFn) -> None:
        self.stream = stream
        # requests to send, each with whether it holds one of spread()'s backpressure slots
        self.queued: collections.deque[tuple[pb.ClassifyRequest, bool]] = collections.deque()
        self.wake = asyncio.Event()
        self.unanswered = 0  # given to this lane, not yet answered
        self.open = True  # takes requests: its stream neither failed nor finished writing
        self.reopening = False  # connecting anew: takes requests only when no lane else does

    def give(self, request: pb.ClassifyRequest, holds_slot: bool) -> None:
        self.unanswered += 1
        self.queued.append((request, holds_slot))
        self.wake.set()


async def spread(
    streams: list[StreamFn],
    requests: Requests,
    reopen: Reopen | None = None,
    resends: int = 0,
) -> AsyncIterator[pb.ClassifyResponse]:
    """Send `requests` over `streams`, yielding every response in completion order.

    Each request goes to the stream with the fewest requests unanswered (a slower replica
    gets fewer; ties take turns). A stream that fails answers its own unanswered requests
    with its status, as one stream does. With `reopen`, a stream that failed with one of
    REOPEN_CODES is replaced by one on a new connection, so the spread stream outlives its
    replicas (a rolling redeploy); otherwise, or once MAX_REOPENS new ones in a row failed
    with no request answered OK in between, the lane leaves: the requests queued for it and
    not yet sent go to the others, or are answered with its status when none is left. Once
    every request is answered, the first failure of a lane that left is raised, as one
    stream raises its own.

    With `resends`, a request answered UNAVAILABLE (its replica is draining), or left
    unanswered by a stream that failed with one of REOPEN_CODES, is sent again on another
    stream (with `reopen` and no other stream open, on its own stream's replacement), up to
    that many times, instead of answered: a classification has no side effects, so running
    it twice is harmless."""
    lanes = [_Lane(stream) for stream in streams]
    responses: asyncio.Queue = asyncio.Queue()
    # Backpressure, as one stream's write gives: at most one request per lane taken from
    # `requests` and not yet written.
    slots = asyncio.Semaphore(len(lanes))
    failures: list[grpc.aio.AioRpcError] = []
    turn = 0
    input_done = False
    # resends > 0: each unanswered request by id, with how often it was sent again
    originals: dict[str, tuple[pb.ClassifyRequest, int]] = {}

    def dispatch(
        request: pb.ClassifyRequest, holds_slot: bool = True, avoid: _Lane | None = None
    ) -> None:
        nonlocal turn
        candidates = [i for i, lane in enumerate(lanes) if lane.open]
        if len(candidates) > 1 and avoid is not None:
            candidates = [i for i in candidates if lanes[i] is not avoid]
        if not candidates:  # every stream failed (or ended early): nowhere to send it
            if holds_slot:
                slots.release()
            code, why = (
                (failures[0].code(), failures[0].details())
                if failures
                else (grpc.StatusCode.UNAVAILABLE, "the streams ended")
            )
            message = f"no connection left to send this request on: {why}"
            responses.put_nowait(error_response(request.request_id, code, message))
            return
        index = min(
            candidates,
            key=lambda i: (lanes[i].reopening, lanes[i].unanswered, (i - turn) % len(lanes)),
        )
        turn = index + 1
        lanes[index].give(request, holds_slot)

    def resend(request_id: str, lane: _Lane) -> bool:
        """Send a request again, if it may be: on another open stream, or, with `reopen`
        and none open, on its own lane's next stream (with one connection, the only way on).
        If that lane cannot reconnect, the request is answered with the lane's failure."""
        request, sent_again = originals.get(request_id, (None, resends))
        others = any(o.open and o is not lane for o in lanes)
        if sent_again >= resends or not (others or reopen is not None):
            return False
        originals[request_id] = (request, sent_again + 1)
        if others:
            dispatch(request, holds_slot=False, avoid=lane)
        else:
            lane.give(request, holds_slot=False)
        return True

    async def outbox(lane: _Lane) -> AsyncIterator[pb.ClassifyRequest]:
        while True:
            while lane.queued:
                request, holds_slot = lane.queued.popleft()
                if holds_slot:
                    slots.release()
                yield request
            if input_done:
                lane.open = False
                return
            lane.wake.clear()
            await lane.wake.wait()

    async def run(index: int, lane: _Lane) -> None:
        failed_in_a_row = 0
        answered_ok = False
        try:
            while True:
                try:
                    async for response in lane.stream(outbox(lane)):
                        lane.unanswered -= 1
                        if not response.error.code:
                            failed_in_a_row, answered_ok = 0, True
                        elif _may_resend(response.error) and resend(response.request_id, lane):
                            continue
                        responses.put_nowait(response)
                    return
                except grpc.aio.AioRpcError as exc:
                    failed_in_a_row += 1
                    if (
                        reopen is None
                        or exc.code() not in REOPEN_CODES
                        or failed_in_a_row > MAX_REOPENS
                    ):
                        failures.append(exc)
                        return
                    if input_done and not lane.queued:
                        return  # nothing left to send: no new connection needed
                    lane.reopening = True
                    try:
                        lane.stream = await reopen(index, answered_ok)
                    except grpc.aio.AioRpcError as dial:
                        failures.append(_reconnect_failure(exc, dial))
                        return
                    finally:
                        lane.reopening = False
        finally:
            lane.open = False
            while lane.queued:  # never sent: safe to send on another connection
                dispatch(*lane.queued.popleft())
            responses.put_nowait(_LANE_DONE)

    async def feed() -> None:
        nonlocal input_done
        try:
            iterator = aiter(as_async(requests))
            while True:
                await slots.acquire()
                if not any(lane.open for lane in lanes):
                    return
                try:
                    request = await anext(iterator)
                except StopAsyncIteration:
                    return
                if resends:
                    originals[request.request_id] = (request, 0)
                dispatch(request)
        finally:
            input_done = True
            for lane in lanes:
                lane.wake.set()

    feeder = asyncio.create_task(feed())
    runners = [asyncio.create_task(run(i, lane)) for i, lane in enumerate(lanes)]
    try:
        finished = 0
        while finished < len(lanes):
            response = await responses.get()
            if response is _LANE_DONE:
                finished += 1
            else:
                originals.pop(response.request_id, None)
                yield response
        # Every stream has ended: stop taking requests (they all failed), then yield what
        # was answered meanwhile.
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        while not responses.empty():
            yield responses.get_nowait()
        if not feeder.cancelled() and feeder.exception() is not None:
            raise feeder.exception()  # the caller's own request iterator failed
        await asyncio.gather(*runners, return_exceptions=True)  # their last steps
        for runner in runners:  # a lane's own bug, not a stream's status
            if not runner.cancelled() and runner.exception() is not None:
                raise runner.exception()
        if failures:
            raise failures[0]
    finally:
        for task in (feeder, *runners):
            task.cancel()
        await asyncio.gather(feeder, *runners, return_exceptions=True)
