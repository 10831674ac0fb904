"""The fair decode pool (serve_app/stages/decode_pool.py) with stand-in decode functions: the order
in which images from different streams get the threads, the heavy-image lane, the per-request
pixel budget. Gates (threading.Event) instead of sleeps decide when a decode finishes."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support import until

from engines.images import InvalidImage
from serve_app.stages.decode_pool import DecodePool
from serve_app.tuning import HEAVY_PIXELS

HEAVY = HEAVY_PIXELS + 1


class Images:
    """Images are names; a name's cost comes from `costs`; decoding waits on its gate."""

    def __init__(self, costs: dict[bytes, int]) -> None:
        self.costs = costs
        self.gates = {name: threading.Event() for name in costs}
        self.started: list[bytes] = []
        self._lock = threading.Lock()

    def cost(self, data: bytes) -> int:
        if data == b"bad":
            raise InvalidImage("bad header")
        return self.costs[data]

    def decode(self, data: bytes) -> str:
        with self._lock:
            self.started.append(data)
        assert self.gates[data].wait(10), f"{data} never released"
        return data.decode().upper()


async def test_a_stream_with_one_photo_does_not_wait_for_another_streams_queue() -> None:
    """One thread; stream a queued five images first, stream b one photo after them. Taken
    in arrival order (a plain thread pool), b's photo would come sixth; in turn, second."""
    names = [f"a{i}".encode() for i in range(5)]
    images = Images({**dict.fromkeys(names, 10), b"b0": 10})
    pool = DecodePool(1, images.cost, images.decode, max_request_pixels=10**9)
    a = asyncio.ensure_future(pool.run(names, flow="a"))
    await until(lambda: images.started == [b"a0"])
    b = asyncio.ensure_future(pool.run([b"b0"], flow="b"))
    await asyncio.sleep(0)  # b's task runs up to its first await: its photo is queued by then
    for gate in images.gates.values():
        gate.set()
    assert await b == ["B0"]
    assert await a == [n.decode().upper() for n in names]
    assert images.started[:2] == [b"a0", b"b0"]


async def test_heavy_images_leave_one_thread_for_cheap_ones() -> None:
    """Two threads, a request of heavy images: only one thread decodes them, so the other
    stream's photo starts at once, while the first heavy image is still decoding."""
    heavy = [f"h{i}".encode() for i in range(4)]
    images = Images({**dict.fromkeys(heavy, HEAVY), b"photo": 10})
    pool = DecodePool(2, images.cost, images.decode, max_request_pixels=10**10)
    attack = asyncio.ensure_future(pool.run(heavy, flow="attacker"))
    await until(lambda: images.started == [b"h0"])
    images.gates[b"photo"].set()
    assert await asyncio.wait_for(pool.run([b"photo"], flow="user"), 5) == ["PHOTO"]
    assert images.started == [b"h0", b"photo"]  # h1..h3 wait for h0's heavy slot
    for gate in images.gates.values():
        gate.set()
    assert await attack == ["H0", "H1", "H2", "H3"]


async def test_images_past_the_request_pixel_budget_fail_alone() -> None:
    images = Images({b"x": 60, b"y": 60, b"z": 30})
    for gate in images.gates.values():
        gate.set()
    pool = DecodePool(1, images.cost, images.decode, max_request_pixels=100)
    results = await pool.run([b"x", b"y", b"z", b"bad"], flow="s")
    assert results[0] == "X" and results[2] == "Z"
    assert isinstance(results[1], InvalidImage) and "budget of 100" in str(results[1])
    assert isinstance(results[3], InvalidImage) and "bad header" in str(results[3])


async def test_a_cancelled_request_skips_its_remaining_images() -> None:
    names = [f"a{i}".encode() for i in range(4)]
    images = Images(dict.fromkeys([*names, b"next"], 10))
    pool = DecodePool(1, images.cost, images.decode, max_request_pixels=10**9)
    task = asyncio.ensure_future(pool.run(names, flow="a"))
    await until(lambda: images.started == [b"a0"])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    images.gates[b"a0"].set()
    images.gates[b"next"].set()
    assert await asyncio.wait_for(pool.run([b"next"], flow="b"), 5) == ["NEXT"]
    assert images.started == [b"a0", b"next"]


async def test_an_unexpected_decoder_error_fails_that_image_alone() -> None:
    """A decoder may raise more than InvalidImage (a PIL plugin's struct.error, a
    MemoryError): the image fails, its request is answered, and the pool's one thread
    decodes the next request."""
    import struct

    images = Images({b"x": 10, b"odd": 10, b"odd-header": 10, b"next": 10})
    for gate in images.gates.values():
        gate.set()

    def cost(data: bytes) -> int:
        if data == b"odd-header":
            raise IndexError("tuple index out of range")
        return images.cost(data)

    def decode(data: bytes) -> str:
        if data == b"odd":
            raise struct.error("unpack requires a buffer of 4 bytes")
        return images.decode(data)

    pool = DecodePool(1, cost, decode, max_request_pixels=10**9)
    results = await asyncio.wait_for(pool.run([b"x", b"odd", b"odd-header"], flow="a"), 5)
    assert results[0] == "X"
    assert isinstance(results[1], InvalidImage) and "unpack requires" in str(results[1])
    assert isinstance(results[2], InvalidImage) and "IndexError" in str(results[2])
    assert await asyncio.wait_for(pool.run([b"next"], flow="b"), 5) == ["NEXT"]
