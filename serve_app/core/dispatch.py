"""The ingress' micro-batching: requests from every stream go to the stages in calls that
carry many of them.

A Ray call costs milliseconds of CPU whatever it carries, so while `settings.calls_in_flight`
calls are in flight new requests queue, and the next call takes everything queued (up to
`requests_per_call`); at low load a lone request goes at once. A request that waited
`spill_after_s` while every call stayed busy goes in an extra call (at most that many extra
at once): a call stuck on one client's expensive images must not hold everyone else's
requests.

A free call slot is not taken by the first request to come while other calls are in flight
and requests arrive fast: it waits up to `gather_s` for more. Otherwise, under load, the
answers of one call make its clients send again a few milliseconds later, and the first of
those requests takes the slot alone and pays a whole call's cost: on the 2-core CPU machine
(the chained default on the echo engine, one-image requests) a tenth of the calls carried one
request, and waiting 3 ms served 2-7% more at 8-10% less CPU an image.

While slots are free, a queue that one call would take whole can instead go in several
calls of at least `spread_images` images each (0: never): one client's burst then runs on
several stage replicas at once, not in one replica's queue. It takes two free slots or more;
under full load slots free one at a time, and calls stay full.

A call carries at most `max_images` images past its first request (0: no bound), and where
more is queued than a call takes (a backlog) it takes the flows' (streams') oldest requests
in turn, not the oldest requests: a client that queued thousands of requests on some
streams does not hold another stream's request for calls on end, nor make it wait for a
huge call's end. A queue that spread calls could carry only past that bound is not spread.

Callbacks, not a future per request: each call answers its requests when it returns, and the
ingress does no work per request beyond queueing it.

The settings (`DispatchSettings`) are worked out at run time (serve_app/core/dispatch_rule.py)
and change as replicas come and go (`retune`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from serve_app import tuning

logger = logging.getLogger(__name__)


class Pending(Protocol):
    """What the dispatcher queues: `done` once answered (a deadline may answer first)."""

    done: bool


P = TypeVar("P", bound=Pending)


@dataclass(frozen=True)
class DispatchSettings:
    requests_per_call: int
    calls_in_flight: int  # per ingress replica; as many extra calls may spill
    gather_s: float = tuning.GATHER_S
    spill_after_s: float = tuning.SPILL_AFTER_S
    spread_images: int = 0  # a burst goes over free slots in calls of this many images (0: never)
    max_images: int = 0  # images a call carries past its first request (0: no bound)


class Dispatcher(Generic[P]):
    def __init__(
        self,
        call: Callable[[list[P]], Awaitable[None]],
        settings: DispatchSettings,
        *,
        images: Callable[[P], int] = lambda item: 1,
        flow: Callable[[P], str] = lambda item: "",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`call(items)` sends one call and answers each item (it must not raise);
        `images(item)`: how many images an item carries (for `spread_images`); `flow(item)`:
        the stream it came on (a backlog's calls take the flows in turn); `clock`: when items
        arrive and how long they waited (tests set it)."""
        self._call, self._clock = call, clock
        self._images, self._flow = images, flow
        self.settings = settings
        # the call count at each queued flow's last turn: least recently served go first
        self._turns, self._last_turn = 0, {}
        self._queue: collections.deque[tuple[P, float]] = collections.deque()
        self._running = 0
        self._spilled = 0
        self._gather_timer: asyncio.TimerHandle | None = None
        self._spill_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._window_start, self._window_arrivals, self._rate = clock(), 0, 0.0

    def retune(self, settings: DispatchSettings) -> None:
        """New settings (serve_app/core/dispatch_rule.py: replicas came or went), from the
        next call on; calls in flight go on. Slots that this frees take queued requests."""
        self.settings = settings
        if self._queue and self._running < settings.calls_in_flight:
            self._fill_slot()

    @property
    def calls_in_flight(self) -> int:
        return self._running + self._spilled

    def submit(self, item: P) -> None:
        now = self._clock()
        self._count_arrival(now)
        self._queue.append((item, now))
        if self._running < self.settings.calls_in_flight:
            self._fill_slot()
        elif self._spill_timer is None:
            self._spill_timer = asyncio.get_running_loop().call_later(
                self.settings.spill_after_s, self._spill
            )

    def _count_arrival(self, now: float) -> None:
        if now - self._window_start >= tuning.RATE_WINDOW_S:
            self._rate = self._window_arrivals / (now - self._window_start)
            self._window_start, self._window_arrivals = now, 0
        self._window_arrivals += 1

    def _fill_slot(self) -> None:
        """A call slot is free: start a call now, or gather first (see the module's doc)."""
        gather = (
            self._running > 0
            and len(self._queue) < self.settings.requests_per_call
            and self._rate * self.settings.gather_s >= 1.0  # another request expected meanwhile
        )
        if not gather:
            self._start_calls()
        elif self._gather_timer is None:
            self._gather_timer = asyncio.get_running_loop().call_later(
                self.settings.gather_s, self._gathered
            )

    def _gathered(self) -> None:
        self._gather_timer = None
        if self._queue and self._running < self.settings.calls_in_flight:
            self._start_calls()

    def _start_calls(self) -> None:
        for items in self._spread() or [self._take()]:
            self._start(items, spill=False)

    def _spread(self) -> list[list[P]]:
        """The queue cut into calls of about equal images, one per free slot at most, each
        of at least `spread_images` images; [] where one call takes it (see the module's
        doc)."""
        settings = self.settings
        free = settings.calls_in_flight - self._running
        if not settings.spread_images or free < 2 or len(self._queue) > settings.requests_per_call:
            return []
        live = [(item, self._images(item)) for item, _ in self._queue if not item.done]
        total = sum(images for _, images in live)
        calls = min(free, total // settings.spread_images, len(live))
        if calls < 2:
            return []
        share = total // calls
        groups: list[list[P]] = [[]]
        placed = own = 0  # images in the groups so far, and in the last one
        for item, images in live:
            full = own >= settings.spread_images and placed >= share * len(groups)
            if full and len(groups) < calls:
                groups.append([])
                own = 0
            groups[-1].append(item)
            placed, own = placed + images, own + images
        if len(groups) > 1 and own < settings.spread_images:  # lumpy items: the last one short
            groups[-2].extend(groups.pop())
        if settings.max_images and any(
            sum(map(self._images, group[1:])) > settings.max_images for group in groups
        ):
            return []  # calls past the bound: _take's bounded calls instead
        self._queue.clear()
        return groups

    def _take(self) -> list[P]:
        if len(self._queue) > self.settings.requests_per_call or self.settings.max_images:
            return self._take_in_turn()
        # answered meanwhile (a deadline passed): not sent
        items = [item for item, _ in self._queue if not item.done]
        self._queue.clear()
        return items

    def _take_in_turn(self) -> list[P]:
        """Each flow's oldest request in turn, the flows least recently served first, up to
        a call's worth of requests and images, sent in the order they came; the rest stay
        queued in that order. (Always starting from the oldest flow would starve the newest
        wherever there are more flows than a call takes.)"""
        queued, self._queue = list(self._queue), collections.deque()
        by_flow: dict[str, list[int]] = {}
        for index, (item, _) in enumerate(queued):
            if not item.done:  # answered meanwhile (its deadline passed): dropped
                by_flow.setdefault(self._flow(item), []).append(index)
        flows = sorted(by_flow, key=lambda flow: self._last_turn.get(flow, -1))
        in_turn = itertools.chain.from_iterable(
            itertools.zip_longest(*(by_flow[flow] for flow in flows))
        )
        taken: set[int] = set()
        images, most = 0, self.settings.max_images
        for index in (i for i in in_turn if i is not None):
            size = self._images(queued[index][0])
            full = most and images + size > most
            if taken and (len(taken) == self.settings.requests_per_call or full):
                break
            taken.add(index)
            images += size
        self._turns += 1
        # a flow had its turn where its oldest request was taken; only queued flows are kept
        self._last_turn = {
            flow: self._turns if by_flow[flow][0] in taken else self._last_turn[flow]
            for flow in flows
            if by_flow[flow][0] in taken or flow in self._last_turn
        }
        items = []
        for index, (item, arrived) in enumerate(queued):
            if index in taken:
                items.append(item)
            elif not item.done:
                self._queue.append((item, arrived))
        return items

    def _start(self, items: list[P], spill: bool) -> None:
        if not items:
            return
        if spill:
            self._spilled += 1
        else:
            self._running += 1
        task = asyncio.ensure_future(self._call(items))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._finished(t, spill))

    def _finished(self, task: asyncio.Task, spill: bool) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # `call` must not raise
            logger.error("a call raised", exc_info=task.exception())
        if spill:
            self._spilled -= 1
        else:
            self._running -= 1
        if self._queue and self._running < self.settings.calls_in_flight:
            self._fill_slot()

    def _spill(self) -> None:
        """Every call stayed busy while the oldest request waited: send an extra call, and
        look again later while requests keep waiting."""
        self._spill_timer = None
        if not self._queue:
            return
        waited = self._clock() - self._queue[0][1]
        if waited >= self.settings.spill_after_s and self._spilled < self.settings.calls_in_flight:
            self._start(self._take(), spill=True)
            waited = 0.0
        if self._queue:
            self._spill_timer = asyncio.get_running_loop().call_later(
                max(self.settings.spill_after_s - waited, 0.001), self._spill
            )
