"""Replica failure in the middle of a stream (the inference replica; the preprocessing replica
in the chained topology): every request sent is answered (correctly, or with UNAVAILABLE),
never dropped, and the same stream goes on once Serve restarts the replica."""

from __future__ import annotations

import asyncio

import pytest

from clients.client import Client
from raystream.v1 import classifier_pb2 as pb

from conftest import start_app

pytestmark = pytest.mark.slow
CATS = range(281, 286)


CASES = [("fused", "Inference"), ("chained", "Preprocess")]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-kill-{case[1]}")
def fault_server(request, ray_cluster, model_repository):
    from ray import serve

    topology, victim = request.param
    port, _ = start_app(
        "faults", model_repository, topology=topology, engine={"kind": "onnxruntime"}
    )
    yield f"127.0.0.1:{port}", victim
    serve.delete("faults")


def _kill_replica(app: str, deployment: str) -> None:
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{app}#{deployment}#" in a["name"]
    ]
    assert names, f"no replica of {app}/{deployment} found"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


async def test_killing_a_replica_loses_no_request(fault_server, photos) -> None:
    address, victim = fault_server
    total, killed = 40, asyncio.Event()

    async def requests():
        for i in range(total):
            if i == 16:  # requests 10..15 (8 images each) are still running now
                await asyncio.sleep(0.2)
                await asyncio.to_thread(_kill_replica, "faults", victim)
                killed.set()
            burst = 10 <= i < 16
            yield pb.ClassifyRequest(
                request_id=str(i), images=[photos["chelsea"]] * (8 if burst else 1)
            )
            if not burst:
                await asyncio.sleep(0.05 if i < 20 else 0.5)  # the tail spans the restart

    async with Client(address) as client:
        responses = [r async for r in client.stream(requests())]
    assert killed.is_set()
    assert sorted(int(r.request_id) for r in responses) == list(range(total))
    outcomes = []
    for response in responses:
        if response.error.code:
            assert response.error.code == 14, response.error  # UNAVAILABLE, says why
            outcomes.append("unavailable")
        else:
            assert response.results[0].labels[0].class_id in CATS
            outcomes.append("ok")
    assert outcomes.count("ok") >= 10  # before the kill, and after the restart
    # After the restart the server answers normally again.
    for _ in range(120):
        async with Client(address) as client:
            response = await client.classify_once([photos["coffee"]])
        if not response.error.code:
            break
        await asyncio.sleep(0.5)
    assert response.error.code == 0 and response.results[0].labels
