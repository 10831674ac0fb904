"""The ingress' micro-batching (serve_app/dispatch.py) with a stand-in call: gates decide
when calls finish."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(eq=False)
class Item:
    name: str
    done: bool = False


class Calls:
    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self.gates: list[asyncio.Event] = []

    async def __call__(self, items: list[Item]) -> None:
        gate = asyncio.Event()
        self.sent.append([item.name for item in items])
        self.gates.append(gate)
        await gate.wait()
        for item in items:
            item.done = True


async def _until(condition) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.001)


async def test_a_call_takes_what_queued_while_the_calls_were_busy() -> None:
    from serve_app.dispatch import Dispatcher

    calls = Calls()
    dispatcher = Dispatcher(calls, max_per_call=2, max_calls=1, spill_after_s=60)
    for name in "abcd":
        dispatcher.submit(Item(name))
    await _until(lambda: calls.sent == [["a"]])
    calls.gates[0].set()
    await _until(lambda: len(calls.sent) == 2)
    calls.gates[1].set()
    await _until(lambda: len(calls.sent) == 3)
    calls.gates[2].set()
    assert calls.sent == [["a"], ["b", "c"], ["d"]]  # at most max_per_call each


async def test_a_request_behind_stuck_calls_spills_into_a_call_of_its_own() -> None:
    """A call stuck on slow work (a client's expensive images) must not hold the next
    request: after spill_after_s it goes in an extra call."""
    from serve_app.dispatch import Dispatcher

    calls = Calls()
    dispatcher = Dispatcher(calls, max_per_call=8, max_calls=1, spill_after_s=0.01)
    dispatcher.submit(Item("slow"))
    await _until(lambda: len(calls.sent) == 1)
    dispatcher.submit(Item("quick"))
    await _until(lambda: len(calls.sent) == 2)
    assert calls.sent == [["slow"], ["quick"]] and not calls.gates[0].is_set()
    for gate in calls.gates:
        gate.set()


async def test_answered_items_are_not_sent() -> None:
    from serve_app.dispatch import Dispatcher

    calls = Calls()
    dispatcher = Dispatcher(calls, max_per_call=8, max_calls=1, spill_after_s=60)
    dispatcher.submit(Item("a"))
    expired = Item("expired")
    dispatcher.submit(expired)
    dispatcher.submit(Item("b"))
    expired.done = True  # its deadline answered it while queued
    await _until(lambda: len(calls.sent) == 1)
    calls.gates[0].set()
    await _until(lambda: len(calls.sent) == 2)
    calls.gates[1].set()
    assert calls.sent == [["a"], ["b"]]
