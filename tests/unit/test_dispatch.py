"""The ingress' micro-batching (serve_app/core/dispatch.py) with a stand-in call: gates decide
when calls finish."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from support import until


@dataclass(eq=False)
class Item:
    name: str
    done: bool = False
    images: int = 1


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


async def _finish(calls: Calls, dispatcher) -> None:
    """Every queued item sent and every call ended, so no call task outlives its test."""
    async with asyncio.timeout(5):
        while dispatcher._queue or dispatcher.calls_in_flight:
            for gate in calls.gates:
                gate.set()
            await asyncio.sleep(0.001)  # polling


async def test_a_call_takes_what_queued_while_the_calls_were_busy() -> None:
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=2, calls_in_flight=1, spill_after_s=60, gather_s=0.0),
    )
    for name in "abcd":
        dispatcher.submit(Item(name))
    await until(lambda: calls.sent == [["a"]])
    calls.gates[0].set()
    await until(lambda: len(calls.sent) == 2)
    calls.gates[1].set()
    await until(lambda: len(calls.sent) == 3)
    calls.gates[2].set()
    assert calls.sent == [["a"], ["b", "c"], ["d"]]  # at most requests_per_call each


async def test_a_request_behind_stuck_calls_spills_into_a_call_of_its_own() -> None:
    """A call stuck on slow work (a client's expensive images) must not hold the next
    request: after spill_after_s it goes in an extra call."""
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=8, calls_in_flight=1, spill_after_s=0.01, gather_s=0.0),
    )
    dispatcher.submit(Item("slow"))
    await until(lambda: len(calls.sent) == 1)
    dispatcher.submit(Item("quick"))
    await until(lambda: len(calls.sent) == 2)
    assert calls.sent == [["slow"], ["quick"]] and not calls.gates[0].is_set()
    for gate in calls.gates:
        gate.set()


async def test_a_backlog_s_calls_take_the_streams_in_turn() -> None:
    """One client queued many requests on two streams; another stream's one request goes in
    the next call, not after the backlog, and each call keeps the order requests came in."""
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=4, calls_in_flight=1, spill_after_s=60, gather_s=0.0),
        flow=lambda item: item.name[0],
    )
    dispatcher.submit(Item("a0"))  # the call in flight
    await until(lambda: len(calls.sent) == 1)
    for i in range(1, 9):
        dispatcher.submit(Item(f"a{i}"))
        dispatcher.submit(Item(f"b{i}"))
    late = Item("v")
    dispatcher.submit(late)
    done = Item("a9", done=True)  # answered (its deadline) while queued: dropped
    dispatcher.submit(done)
    calls.gates[0].set()
    await until(lambda: len(calls.sent) == 2)
    assert calls.sent[1] == ["a1", "b1", "a2", "v"]
    for n in range(2, 6):
        calls.gates[n - 1].set()
        await until(lambda n=n: len(calls.sent) == n + 1 or not dispatcher._queue)
    sent = [name for call in calls.sent for name in call]
    assert sorted(sent) == sorted(["a0", *(f"{c}{i}" for c in "ab" for i in range(1, 9)), "v"])
    assert "a9" not in sent and len(sent) == len(set(sent))  # each sent once
    await _finish(calls, dispatcher)


async def test_more_streams_than_a_call_takes_each_get_their_turn() -> None:
    """Calls smaller than the number of streams: the stream that came last still gets into
    the next calls, not after every older stream's backlog."""
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=2, calls_in_flight=1, spill_after_s=60, gather_s=0.0),
        flow=lambda item: item.name[0],
    )
    dispatcher.submit(Item("x"))  # the call in flight
    await until(lambda: len(calls.sent) == 1)
    for i in range(5):
        for flow in "abc":
            dispatcher.submit(Item(f"{flow}{i}"))
    dispatcher.submit(Item("v"))
    for n in range(1, 3):
        calls.gates[n - 1].set()
        await until(lambda n=n: len(calls.sent) == n + 1)
    assert calls.sent[1:] == [["a0", "b0"], ["c0", "v"]]
    await _finish(calls, dispatcher)


async def test_a_call_carries_at_most_max_images_past_its_first_item() -> None:
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    settings = DispatchSettings(8, 1, gather_s=0.0, spill_after_s=60, max_images=10)
    dispatcher = Dispatcher(calls, settings, images=lambda item: item.images)
    dispatcher.submit(Item("big", images=20))  # alone over the bound: it still goes
    await until(lambda: len(calls.sent) == 1)
    for name in "abc":
        dispatcher.submit(Item(name, images=4))
    for n in range(1, 3):
        calls.gates[n - 1].set()
        await until(lambda n=n: len(calls.sent) == n + 1)
    assert calls.sent == [["big"], ["a", "b"], ["c"]]
    await _finish(calls, dispatcher)


async def test_answered_items_are_not_sent() -> None:
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=8, calls_in_flight=1, spill_after_s=60, gather_s=0.0),
    )
    dispatcher.submit(Item("a"))
    expired = Item("expired")
    dispatcher.submit(expired)
    dispatcher.submit(Item("b"))
    expired.done = True  # its deadline answered it while queued
    await until(lambda: len(calls.sent) == 1)
    calls.gates[0].set()
    await until(lambda: len(calls.sent) == 2)
    calls.gates[1].set()
    assert calls.sent == [["a"], ["b"]]


class Clock:
    """The dispatcher's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _burst_after_a_call(dispatcher, monkeypatch, spacing_s: float = 0.06) -> None:
    """One call in flight, then `spacing_s` on the dispatcher's clock: a window long enough
    to measure the arrivals' rate (one arrival in 60 ms: about 17 a second)."""
    import serve_app.tuning

    monkeypatch.setattr(serve_app.tuning, "RATE_WINDOW_S", 0.05)
    dispatcher.submit(Item("a"))
    dispatcher._clock.now += spacing_s
    await _turns()


async def _turns(n: int = 3) -> None:
    """A few turns of the loop: a call started now has run to its gate, none that waits
    on a timer has."""
    for _ in range(n):
        await asyncio.sleep(0)  # yields to the loop


async def test_a_free_slot_gathers_while_calls_run_and_requests_come_fast(monkeypatch) -> None:
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=8, calls_in_flight=2, gather_s=0.2, spill_after_s=60),
        clock=Clock(),
    )
    await _burst_after_a_call(dispatcher, monkeypatch)
    dispatcher.submit(Item("b"))  # a slot is free, but 17/s x 0.2 s: more are expected
    dispatcher.submit(Item("c"))
    await _turns()
    assert calls.sent == [["a"]]
    await until(lambda: len(calls.sent) == 2)
    assert calls.sent == [["a"], ["b", "c"]]
    for gate in calls.gates:
        gate.set()


async def test_a_lone_request_goes_at_once_when_requests_come_slowly(monkeypatch) -> None:
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=8, calls_in_flight=2, gather_s=10, spill_after_s=60),
        clock=Clock(),
    )
    await _burst_after_a_call(dispatcher, monkeypatch, spacing_s=20)
    dispatcher.submit(Item("b"))  # 0.05/s x 10 s: nothing more expected meanwhile
    await _turns()  # at once: a wait of gather_s would leave it unsent for 10 s
    assert calls.sent == [["a"], ["b"]]
    for gate in calls.gates:
        gate.set()


async def test_a_full_call_goes_at_once_while_gathering(monkeypatch) -> None:
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    calls = Calls()
    dispatcher = Dispatcher(
        calls,
        DispatchSettings(requests_per_call=2, calls_in_flight=2, gather_s=10, spill_after_s=60),
        clock=Clock(),
    )
    await _burst_after_a_call(dispatcher, monkeypatch)
    dispatcher.submit(Item("b"))
    dispatcher.submit(Item("c"))  # requests_per_call reached: no reason to wait
    await _turns()
    assert calls.sent == [["a"], ["b", "c"]]
    for gate in calls.gates:
        gate.set()


def _spreading(calls: Calls, spread_images: int, calls_in_flight: int = 4, max_images: int = 0):
    from serve_app.core.dispatch import Dispatcher, DispatchSettings

    return Dispatcher(
        calls,
        DispatchSettings(
            requests_per_call=16,
            calls_in_flight=calls_in_flight,
            gather_s=0.2,
            spill_after_s=60,
            spread_images=spread_images,
            max_images=max_images,
        ),
        images=lambda item: item.images,
        clock=Clock(),
    )


async def _gathered_burst(dispatcher, calls: Calls, monkeypatch, sizes: list[int]) -> list:
    """One call in flight ("a"), then a burst of items of `sizes` images that a free slot
    gathers; the calls sent by then, once every call has finished, each item sent once."""
    await _burst_after_a_call(dispatcher, monkeypatch)
    for number, size in enumerate(sizes):
        dispatcher.submit(Item(f"i{number}", images=size))
    await until(lambda: len(calls.sent) > 1)
    await _turns()  # the burst's calls start together: each has run to its gate by then
    sent = list(calls.sent)
    calls.gates[0].set()  # a slot frees while the burst's calls run: nothing is sent twice
    await _turns()
    await _finish(calls, dispatcher)  # whatever the freed slot queued or sent, sent and ended
    names = [name for call in calls.sent for name in call]
    assert sorted(names) == sorted({"a", *(f"i{n}" for n in range(len(sizes)))})
    return sent


async def test_a_burst_is_spread_over_the_free_slots(monkeypatch) -> None:
    """One client's burst goes to several stage replicas at once: three free slots, six
    items of 8 images and at least 16 images a call make three calls of two items."""
    calls = Calls()
    dispatcher = _spreading(calls, spread_images=16)
    sent = await _gathered_burst(dispatcher, calls, monkeypatch, [8] * 6)
    assert sent == [["a"], ["i0", "i1"], ["i2", "i3"], ["i4", "i5"]]


async def test_spread_calls_share_the_images_not_the_items(monkeypatch) -> None:
    calls = Calls()
    dispatcher = _spreading(calls, spread_images=8)
    sent = await _gathered_burst(dispatcher, calls, monkeypatch, [16, 4, 4, 4, 4])
    assert sent == [["a"], ["i0"], ["i1", "i2"], ["i3", "i4"]]  # 16, 8 and 8 images


@pytest.mark.parametrize(
    ("spread_images", "sizes", "expected"),
    [
        (16, [8, 8, 8, 8, 1], [["i0", "i1"], ["i2", "i3", "i4"]]),
        (2, [100, 1, 1, 1], [["i0"], ["i1", "i2", "i3"]]),
    ],
)
async def test_no_spread_call_falls_short_of_the_minimum(
    monkeypatch, spread_images, sizes, expected
) -> None:
    """Lumpy items: what an equal share would leave in a call of fewer than spread_images
    images joins the call before it."""
    calls = Calls()
    dispatcher = _spreading(calls, spread_images=spread_images)
    sent = await _gathered_burst(dispatcher, calls, monkeypatch, sizes)
    assert sent == [["a"], *expected]


async def test_no_spread_below_the_minimum_or_when_off(monkeypatch) -> None:
    """Calls of fewer than spread_images images would cost more than they save: 24 images
    at 16 a call go in one call; spread_images 0 never spreads."""
    for spread_images in (16, 0):
        calls = Calls()
        dispatcher = _spreading(calls, spread_images=spread_images)
        sent = await _gathered_burst(dispatcher, calls, monkeypatch, [8] * 3)
        assert sent == [["a"], ["i0", "i1", "i2"]]


async def test_no_spread_without_free_slots(monkeypatch) -> None:
    """Under full load calls stay full: with one slot free the burst goes in one call."""
    calls = Calls()
    dispatcher = _spreading(calls, spread_images=8, calls_in_flight=2)
    sent = await _gathered_burst(dispatcher, calls, monkeypatch, [8] * 6)
    assert sent == [["a"], [f"i{n}" for n in range(6)]]


async def test_spread_calls_keep_to_max_images(monkeypatch) -> None:
    """Spread calls are bounded like any other call: a burst that spread calls could carry
    only past max_images (calls of four 4-image items, 12 images past the first, with a
    bound of 4) goes in bounded calls instead; within the bound it is spread as before."""
    calls = Calls()
    dispatcher = _spreading(calls, spread_images=8, max_images=8)
    sent = await _gathered_burst(dispatcher, calls, monkeypatch, [8] * 6)
    assert sent == [["a"], ["i0", "i1"], ["i2", "i3"], ["i4", "i5"]]
    calls = Calls()
    dispatcher = _spreading(calls, spread_images=8, max_images=4)
    await _gathered_burst(dispatcher, calls, monkeypatch, [4] * 12)
    assert max(len(call) for call in calls.sent) == 2, calls.sent  # 4 images past the first
