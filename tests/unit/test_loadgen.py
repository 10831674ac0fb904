"""The load generator's requests, without a server: what it sends is what it stands for."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np

from clients.loadgen import Workload, _requests
from raystream.v1 import classifier_pb2 as pb


def _sent(workload: Workload, count: int) -> list[pb.ClassifyRequest]:
    async def take() -> list[pb.ClassifyRequest]:
        sent: dict[str, float] = {}
        slots = asyncio.Semaphore(count)
        requests = _requests(workload, sent, slots, time.perf_counter() + 60, "s0", random.Random())
        encoded = [request async for request in requests]
        assert list(sent) == [request.request_id for request in encoded]
        parsed = [pb.ClassifyRequest.FromString(request.data) for request in encoded]
        assert [p.request_id for p in parsed] == [request.request_id for request in encoded]
        return parsed

    return asyncio.run(take())


def test_encoded_requests_parse_as_the_messages_they_stand_for() -> None:
    images = (b"\xff\xd8a", b"\x89PNGbb", b"ccc")
    workload = Workload(images=images, batch_size=2, top_k=3, max_requests=3)
    a, b, c = images
    assert _sent(workload, 3) == [
        pb.ClassifyRequest(request_id="s0-0", top_k=3, images=[a, b]),
        pb.ClassifyRequest(request_id="s0-1", top_k=3, images=[c, a]),
        pb.ClassifyRequest(request_id="s0-2", top_k=3, images=[b, c]),
    ]


def test_encoded_pixel_requests_hold_batch_size_rows() -> None:
    pixels = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    workload = Workload(images=(), batch_size=3, pixels=pixels, max_requests=2)
    rows = np.concatenate([pixels, pixels[:1]])  # cycled through to batch_size rows
    tensor = pb.Tensor(shape=rows.shape, data=rows.astype("<f4").tobytes())
    assert _sent(workload, 2) == [
        pb.ClassifyRequest(request_id=f"s0-{i}", top_k=5, pixels=tensor) for i in range(2)
    ]
