"""Replica failure in the middle of a stream (the inference replica; the preprocessing replica
in the chained topology): every request sent is answered (correctly, or with UNAVAILABLE),
never dropped, and the same stream goes on once Serve restarts the replica."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from clients.client import Client
from raystream.v1 import classifier_pb2 as pb

from conftest import start_app

pytestmark = pytest.mark.slow
CATS = range(281, 286)


# (topology, stage calls, the deployment whose replica is killed); over ports the call to
# the dead replica fails and goes again by handle (serve_app/transport/stage_port.py)
CASES = [
    ("fused", "handle", "Inference"),
    ("chained", "handle", "Preprocess"),
    ("chained", "port", "Inference"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "{}-{}-kill-{}".format(*case))
def fault_server(request, ray_cluster, model_repository):
    from ray import serve

    topology, calls, victim = request.param
    port, _ = start_app(
        "faults",
        model_repository,
        topology=topology,
        stage_ports=(9100, 9163) if calls == "port" else None,
        engine={"kind": "onnxruntime"},
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
    for _ in range(300):  # ray.kill only asks: poll until the replica is gone
        try:
            ray.get_actor(names[0], namespace="serve")
        except ValueError:
            return
        time.sleep(0.1)  # polling
    raise AssertionError(f"replica {names[0]} still alive 30 s after ray.kill")


async def test_killing_a_replica_loses_no_request(fault_server, photos) -> None:
    address, victim = fault_server
    killed, recovered = asyncio.Event(), asyncio.Event()
    after_kill: set[str] = set()  # ids of the requests sent once the replica was dead

    async def requests():
        for i in range(16):  # ten single photos, then a burst of six 8-photo requests
            burst = i >= 10
            yield pb.ClassifyRequest(
                request_id=str(i), images=[photos["chelsea"]] * (8 if burst else 1)
            )
            if not burst:
                await asyncio.sleep(0.05)  # pacing
        await asyncio.sleep(0.2)  # pacing: the burst is being decoded and run now
        await asyncio.to_thread(_kill_replica, "faults", victim)
        killed.set()
        # Then one request every half second, until one is answered by the restarted replica
        # (Serve notices the death and starts another: seconds, up to a minute on a busy box).
        for i in itertools.count(16):
            if recovered.is_set() or i == 16 + 240:
                return
            after_kill.add(str(i))
            yield pb.ClassifyRequest(request_id=str(i), images=[photos["chelsea"]])
            await asyncio.sleep(0.5)  # pacing

    responses = []
    async with Client(address) as client:
        async for response in client.stream(requests()):
            responses.append(response)
            if response.request_id in after_kill and not response.error.code:
                recovered.set()
    assert killed.is_set()
    sent = 16 + len(after_kill)
    assert sorted(int(r.request_id) for r in responses) == list(range(sent))  # each once
    for response in responses:
        if response.error.code:
            assert response.error.code == 14, response.error  # UNAVAILABLE, says why
        else:
            assert response.results[0].labels[0].class_id in CATS
    # The same stream went on past the kill: a request sent after it was answered correctly.
    assert recovered.is_set(), [r.error.message for r in responses[-3:]]
