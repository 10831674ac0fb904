"""A bounded soak at 3x the measured capacity: the real model on ONNX Runtime, open-loop
Poisson arrivals over several streams for a minute (RAYSTREAM_SOAK_S; bench/soak.sh runs it
for longer). Every request is answered exactly once (a result, or RESOURCE_EXHAUSTED at
once), a refusal comes before the admitted requests' answers (it waits for nothing), and
the resident memory of the ingress and inference processes stays within a small bound. No
absolute latency is asserted: this box's speed and whatever else runs on it set that."""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time

import numpy as np
import pytest

from clients.client import Client
from clients.loadgen import Workload, run_load
from raystream.v1 import classifier_pb2 as pb

from conftest import start_app

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("RAYSTREAM_SOAK_S", "45"))
WARMUP_S = 10.0
IMAGES_PER_REQUEST = 4
MAX_IN_FLIGHT_REQUESTS = 16  # the ingress admits this many; the rest are refused at once
MEMORY_BOUND_BYTES = 64 * 1024 * 1024  # growth allowed per process after warm-up
OK, RESOURCE_EXHAUSTED = 0, 8


@pytest.fixture(scope="module")
def soak_server(ray_cluster, model_repository):
    from ray import serve

    port, ingress = start_app(
        "soak",
        model_repository,
        topology="fused",
        engine={"kind": "onnxruntime"},
        limits={"max_in_flight_requests": MAX_IN_FLIGHT_REQUESTS},
    )
    yield f"127.0.0.1:{port}", ingress, serve.get_deployment_handle("Inference", "soak")
    serve.delete("soak")


async def _open_loop_stream(address, image, rate, until, answers, sent_at, index):
    rng = random.Random(index)

    async def requests():
        next_at = time.perf_counter()
        for i in range(1 << 30):
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))  # pacing
            if time.perf_counter() >= until:
                return
            request_id = f"{index}-{i}"
            sent_at[request_id] = time.perf_counter()
            yield pb.ClassifyRequest(request_id=request_id, images=[image] * IMAGES_PER_REQUEST)

    async with Client(address) as client:
        async for response in client.stream(requests()):
            answers[response.request_id].append(response)


async def test_three_times_capacity_for_a_while(soak_server, photos) -> None:
    address, ingress, inference = soak_server
    image = photos["chelsea"]
    capacity = await run_load(
        address,
        Workload(
            images=(image,), batch_size=IMAGES_PER_REQUEST, streams=4, in_flight=2, duration_s=8
        ),
    )
    streams = 4
    rate = 3 * capacity.requests_per_s / streams  # requests/s per stream
    answers: collections.defaultdict[str, list[pb.ClassifyResponse]] = collections.defaultdict(list)
    sent_at: dict[str, float] = {}
    start = time.perf_counter()
    until = start + WARMUP_S + SOAK_S
    load = asyncio.gather(
        *(
            _open_loop_stream(address, image, rate, until, answers, sent_at, i)
            for i in range(streams)
        )
    )
    memory: list[tuple[int, int]] = []
    while not load.done():
        await asyncio.sleep(5.0)  # sampling period
        if time.perf_counter() - start >= WARMUP_S:
            memory.append(
                (await ingress.memory_bytes.remote(), await inference.memory_bytes.remote())
            )
    await load

    # Exactly one answer per request: a result or an immediate refusal.
    assert set(answers) == set(sent_at)
    assert all(len(a) == 1 for a in answers.values())
    responses = [a[0] for a in answers.values()]
    codes = collections.Counter(r.error.code for r in responses)
    assert set(codes) <= {OK, RESOURCE_EXHAUSTED}, codes
    assert codes[OK] > 0 and codes[RESOURCE_EXHAUSTED] > 0
    admitted = np.array([r.timing.total_ms for r in responses if r.error.code == OK])
    refused = np.array([r.timing.total_ms for r in responses if r.error.code != OK])
    growth = np.array(memory[-1]) - np.array(memory[0])
    print(
        f"\nsoak {SOAK_S:.0f}s at {3 * capacity.requests_per_s:.1f} req/s "
        f"(3x capacity {capacity.images_per_s:.1f} img/s): {codes[OK]} admitted, "
        f"p50/p99 {np.percentile(admitted, 50):.0f}/{np.percentile(admitted, 99):.0f} ms; "
        f"{codes[RESOURCE_EXHAUSTED]} refused, p99 "
        f"{np.percentile(refused, 99):.1f} ms; memory MiB ingress "
        f"{memory[0][0] / 2**20:.0f}->{memory[-1][0] / 2**20:.0f}, inference "
        f"{memory[0][1] / 2**20:.0f}->{memory[-1][1] / 2**20:.0f}"
    )
    # A refusal waits for nothing: it comes before most admitted answers do.
    assert np.percentile(refused, 99) < np.percentile(admitted, 50)
    assert max(growth) <= MEMORY_BOUND_BYTES, growth
    assert await ingress.requests_in_flight.remote() == 0
