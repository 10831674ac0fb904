"""DynamicBatcher: batches form when the engine is free; timing through asyncio gates."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.errors import DeadlineExceeded, Overloaded, Unavailable
from serve_app.stages.batching import DynamicBatcher


class GatedEngine:
    """A fake engine for batching tests only: records batches, runs when its gate opens."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    async def run(self, items: list[list[int]]) -> list[int]:
        self.batches.append([len(i) for i in items])
        self.started.set()
        await self.gate.wait()
        return [sum(i) for i in items]


async def test_requests_queued_while_busy_form_one_batch() -> None:
    engine = GatedEngine()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=10)
    first = asyncio.create_task(batcher.submit([1]))
    await engine.started.wait()  # the engine is now busy with [1]
    rest = [asyncio.create_task(batcher.submit([2] * n)) for n in (3, 4, 5)]
    await asyncio.sleep(0)  # yields to the loop
    engine.gate.set()
    results = await asyncio.gather(first, *rest)
    assert [r for r, _ in results] == [1, 6, 8, 10]
    # 3 + 4 fit in 10 images; 5 more would not, so it runs next.
    assert engine.batches == [[1], [3, 4], [5]]
    await batcher.close()


async def test_cancelled_requests_never_reach_the_engine() -> None:
    engine = GatedEngine()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=10)
    first = asyncio.create_task(batcher.submit([1]))
    await engine.started.wait()
    doomed = asyncio.create_task(batcher.submit([7, 7]))
    kept = asyncio.create_task(batcher.submit([5]))
    await asyncio.sleep(0)  # yields to the loop
    doomed.cancel()
    engine.gate.set()
    assert (await first)[0] == 1 and (await kept)[0] == 5
    assert engine.batches == [[1], [1]]
    assert batcher.queued_images == 0
    await batcher.close()


async def test_requests_past_their_deadline_never_reach_the_engine() -> None:
    engine = GatedEngine()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=10)
    first = asyncio.create_task(batcher.submit([1]))
    await engine.started.wait()
    # Its deadline is reached while it waits for the busy engine (no sleep needed: now).
    expired = asyncio.create_task(batcher.submit([7, 7], deadline=time.time()))
    kept = asyncio.create_task(batcher.submit([5], deadline=time.time() + 60))
    await asyncio.sleep(0)  # both queued
    engine.gate.set()
    with pytest.raises(DeadlineExceeded, match="batch queue"):
        await expired
    assert (await first)[0] == 1 and (await kept)[0] == 5
    assert engine.batches == [[1], [1]]
    assert batcher.queued_images == 0
    await batcher.close()


async def test_full_queue_rejects_at_once() -> None:
    engine = GatedEngine()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=4, max_queued=4)
    running = asyncio.create_task(batcher.submit([1]))
    await engine.started.wait()
    queued = asyncio.create_task(batcher.submit([1, 1, 1, 1]))
    await asyncio.sleep(0)  # yields to the loop
    with pytest.raises(Overloaded, match="queue is full"):
        await batcher.submit([1])
    engine.gate.set()
    assert (await queued)[0] == 4 and (await running)[0] == 1
    await batcher.close()


async def test_an_engine_error_fails_its_batch_only() -> None:
    calls = 0

    async def flaky(items: list[list[int]]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("device lost")
        return [len(i) for i in items]

    batcher = DynamicBatcher(flaky, len, max_batch_size=4)
    with pytest.raises(RuntimeError, match="device lost"):
        await batcher.submit([1])
    assert (await batcher.submit([1, 2]))[0] == 2
    await batcher.close()


async def _loop_turns(count: int = 20) -> None:
    """Let every ready task run `count` times: far more than a free worker needs to take a
    queued request to the engine (one or two)."""
    for _ in range(count):
        await asyncio.sleep(0)  # yields to the loop


async def test_closing_fails_every_request_queued_or_running() -> None:
    """A model version unloaded while requests are in its batcher (past the unload's drain
    timeout): the running batch's and the queued requests fail with Unavailable instead of
    waiting for good, and a request submitted after the close fails at once."""
    engine = GatedEngine()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=2)
    running = asyncio.create_task(batcher.submit([1]))
    await engine.started.wait()
    queued = [asyncio.create_task(batcher.submit([2])) for _ in range(3)]
    await asyncio.sleep(0)  # yields to the loop
    await batcher.close()
    for task in [running, *queued]:
        with pytest.raises(Unavailable, match="unloaded"):
            await asyncio.wait_for(task, 1)
    with pytest.raises(Unavailable):
        await batcher.submit([3])
    assert engine.batches == [[1]] and batcher.queued_images == 0


async def test_max_delay_waits_for_company() -> None:
    engine = GatedEngine()
    engine.gate.set()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=4, max_delay_s=5.0)
    first = asyncio.create_task(batcher.submit([1, 1]))
    await _loop_turns()
    assert not engine.started.is_set()  # the engine is free, yet the lone request waits
    second = asyncio.create_task(batcher.submit([1, 1]))
    # The batch is full (4 images): it runs at once, long before the 5 s delay.
    await asyncio.wait_for(asyncio.gather(first, second), timeout=2.0)
    assert engine.batches == [[2, 2]]
    await batcher.close()


async def test_without_max_delay_a_lone_request_runs_at_once() -> None:
    engine = GatedEngine()
    engine.gate.set()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=4)
    first = asyncio.create_task(batcher.submit([1, 1]))
    await _loop_turns()
    assert engine.started.is_set()  # (what the test above would see if the delay were lost)
    second = asyncio.create_task(batcher.submit([1, 1]))
    await asyncio.gather(first, second)
    assert engine.batches == [[2], [2]]
    await batcher.close()


async def test_concurrent_batches_change_at_run_time() -> None:
    running, most = 0, 0

    async def engine(items: list[int]) -> list[int]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)  # simulated engine work
        running -= 1
        return items

    batcher = DynamicBatcher(engine, lambda item: 1, max_batch_size=1, max_concurrent=2)
    batcher.set_concurrency(1)
    await asyncio.gather(*(batcher.submit(i) for i in range(6)))
    assert most == 1
    batcher.set_concurrency(2)
    await asyncio.gather(*(batcher.submit(i) for i in range(6)))
    assert most == 2
    with pytest.raises(ValueError, match=r"1\.\.2"):
        batcher.set_concurrency(3)
    await batcher.close()
