"""DynamicBatcher: batches form when the engine is free; timing through asyncio gates."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.batching import DynamicBatcher
from serve_app.errors import DeadlineExceeded, Overloaded


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
    await asyncio.sleep(0)
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
    await asyncio.sleep(0)
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
    expired = asyncio.create_task(batcher.submit([7, 7], deadline=time.time() + 0.01))
    kept = asyncio.create_task(batcher.submit([5], deadline=time.time() + 60))
    await asyncio.sleep(0.05)  # the first deadline passes while the engine is busy
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
    await asyncio.sleep(0)
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


async def test_max_delay_waits_for_company() -> None:
    engine = GatedEngine()
    engine.gate.set()
    batcher = DynamicBatcher(engine.run, len, max_batch_size=4, max_delay_s=5.0)
    tasks = [asyncio.create_task(batcher.submit([1, 1])) for _ in range(2)]
    await asyncio.gather(*tasks)  # the batch filled (4 images) long before the delay
    assert engine.batches == [[2, 2]]
    await batcher.close()
