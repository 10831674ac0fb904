"""The stream runner shared by both protocols (serve_app/protocol/streams.py), without gRPC: answers
made by coroutines (TaskStarter), as the Open Inference Protocol's stream makes them."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.protocol.streams import StreamRunner, TaskStarter


async def _requests(*items):
    for item in items:
        yield item


async def _collect(runner: StreamRunner, requests, answer, **kwargs) -> list:
    return [a async for a in runner.run(requests, TaskStarter(answer), **kwargs)]


async def test_answers_run_concurrently_and_come_in_completion_order() -> None:
    """Request a can only finish after b is answered, so a runner that answered one request
    at a time would never end."""
    b_answered = asyncio.Event()

    async def answer(request: str) -> str:
        if request == "a":
            await b_answered.wait()
        if request == "b":
            b_answered.set()
        return request.upper()

    runner = StreamRunner(max_in_flight=4)
    answers = await asyncio.wait_for(_collect(runner, _requests("a", "b", "c"), answer), 5)
    assert answers.index("B") < answers.index("A") and sorted(answers) == ["A", "B", "C"]


async def test_in_flight_limit_holds_back_reading() -> None:
    running, peak = 0, 0

    async def answer(request: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)  # simulated work
        running -= 1
        return request

    runner = StreamRunner(max_in_flight=2)
    answers = await _collect(runner, _requests(*range(8)), answer)
    assert sorted(answers) == list(range(8)) and peak == 2


async def test_a_key_already_in_flight_gets_the_duplicate_answer() -> None:
    release = asyncio.Event()

    async def answer(request: str) -> str:
        await release.wait()
        return f"done {request}"

    def duplicate(request: str) -> str:
        release.set()
        return f"duplicate {request}"

    runner = StreamRunner(max_in_flight=4)
    answers = await asyncio.wait_for(
        _collect(runner, _requests("x", "x"), answer, key=str, duplicate=duplicate), 5
    )
    assert answers == ["duplicate x", "done x"]


async def test_a_failing_answer_ends_the_stream_with_its_error() -> None:
    async def answer(request: str) -> str:
        if request == "bug":
            raise RuntimeError("answer has a bug")
        return request

    runner = StreamRunner(max_in_flight=1)
    with pytest.raises(RuntimeError, match="answer has a bug"):
        await asyncio.wait_for(_collect(runner, _requests("ok", "bug", "never"), answer), 5)


async def test_a_request_holds_its_slot_until_its_answer_is_taken() -> None:
    """A client that stops reading: answers are computed but nobody takes them. Reading must
    stop at the in-flight limit (before, slots were freed when an answer was computed and the
    queue of answers grew without bound)."""
    read = 0

    async def requests():
        nonlocal read
        for i in range(1000):
            read += 1
            yield i

    async def answer(request: int) -> int:
        return request

    runner = StreamRunner(max_in_flight=4)
    stream = runner.run(requests(), TaskStarter(answer))
    # The consumer takes one answer, then stops (gRPC asks for the next answer only once it
    # has sent this one, which waits while the client's flow-control window is full).
    first = await anext(stream)
    for _ in range(50):  # let every task that could run, run
        await asyncio.sleep(0)  # yields to the loop
    assert first == 0 and read == 4
    await stream.aclose()


async def test_the_byte_budget_holds_back_reading() -> None:
    read = 0
    release = asyncio.Event()

    async def requests():
        nonlocal read
        for _ in range(100):
            read += 1
            yield b"x" * 400

    async def answer(request: bytes) -> int:
        await release.wait()
        return len(request)

    runner = StreamRunner(max_in_flight=64, max_buffered_bytes=1000)
    task = asyncio.ensure_future(_collect(runner, requests(), answer, size=len))
    for _ in range(50):
        await asyncio.sleep(0)  # yields to the loop
    assert read == 3  # 1,200 bytes: the third request crossed the budget, reading paused
    release.set()
    assert await asyncio.wait_for(task, 5) == [400] * 100


async def test_a_task_starter_abandons_what_still_runs_when_its_stream_ends() -> None:
    """OIP's stream ends (the client left): its requests still running are cancelled, so
    the core abandons them (work skipped, in-flight slots given back), as v1's stream does."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def requests():
        yield 1

    async def answer(request: int) -> int:
        started.set()
        try:
            await asyncio.sleep(60)  # simulated work, until cancelled
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return request

    start = TaskStarter(answer)
    stream = StreamRunner(max_in_flight=4).run(requests(), start)
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.wait_for(started.wait(), 5)
    waiting.cancel()  # the client went away while the request ran
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await stream.aclose()
    start.cancel()  # what ModelStreamInfer does once its stream has ended
    await asyncio.wait_for(cancelled.wait(), 5)
