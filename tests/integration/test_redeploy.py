"""Redeploy and shutdown under load, through a Serve config applied the way `serve deploy`
applies it: a `user_config` change reaches the running replica without a restart; a change
that restarts replicas drains the old ingress (what it read is answered, the rest of the
stream gets UNAVAILABLE) while new streams on the same port reach the new one, and the
client's stream, reconnecting, carries on there; deleting the application answers every
request and then refuses new calls. The engine is the echo engine with a delay (these tests
are about transport)."""

from __future__ import annotations

import asyncio
import collections
import itertools

import grpc
import pytest

from clients.client import Client
from raystream.v1 import classifier_pb2 as pb

from conftest import deploy_app, free_port

pytestmark = pytest.mark.slow

APP = "redeploy"
OK, UNAVAILABLE = 0, grpc.StatusCode.UNAVAILABLE.value[0]


def _deploy(
    model_repository,
    port: int,
    *,
    max_batch_size: int,
    log_sample_rate: float,
    max_queued_images: int = 4096,
) -> None:
    deploy_app(
        {
            "name": APP,
            "route_prefix": None,
            "import_path": "serve_app.app:build_app",
            "args": {
                "port": port,
                "model_repository": str(model_repository),
                "topology": "fused",
                "engine": {"kind": "echo", "options": {"delay_ms": 50}},
                "log_sample_rate": log_sample_rate,
            },
            "deployments": [
                {"name": "Ingress", "max_surge_percent": 100},
                {
                    "name": "Inference",
                    "user_config": {
                        "max_batch_size": max_batch_size,
                        "max_queued_images": max_queued_images,
                    },
                },
            ],
        }
    )


def _inference():
    from ray import serve

    return serve.get_deployment_handle("Inference", APP)


@pytest.fixture(scope="module")
def port(ray_cluster, model_repository) -> int:
    port = free_port()
    _deploy(model_repository, port, max_batch_size=8, log_sample_rate=0.0)
    return port


class Traffic:
    """One stream sending a 1-image request every 20 ms until stopped; records answers.
    `client_options` go to Client (reconnect=False: the server's own contract shows)."""

    def __init__(self, address: str, image: bytes, **client_options: object) -> None:
        self._address, self._image, self._options = address, image, client_options
        self.sent: list[str] = []
        self.answers: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
        self.stream_error: grpc.aio.AioRpcError | None = None
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _requests(self):
        for i in itertools.count():
            if self._stop.is_set():
                return
            self.sent.append(f"r{i}")
            yield pb.ClassifyRequest(request_id=f"r{i}", images=[self._image])
            await asyncio.sleep(0.02)  # pacing

    async def _run(self) -> None:
        async with Client(self._address, **self._options) as client:
            try:
                async for response in client.stream(self._requests()):
                    self.answers[response.request_id].append(response.error.code)
            except grpc.aio.AioRpcError as exc:
                self.stream_error = exc

    async def answered(self, count: int) -> None:
        while sum(map(len, self.answers.values())) < count:
            await asyncio.sleep(0.05)  # polling

    async def ended(self, timeout: float) -> None:
        await asyncio.wait_for(self._task, timeout)

    async def finish(self, timeout: float = 60.0) -> None:
        self._stop.set()
        await asyncio.wait_for(self._task, timeout)

    def codes(self) -> collections.Counter[int]:
        assert sorted(self.answers) == sorted(self.sent)  # every request answered ...
        assert all(len(codes) == 1 for codes in self.answers.values())  # ... exactly once
        return collections.Counter(codes[0] for codes in self.answers.values())


async def test_user_config_change_applies_to_the_running_replica(
    port, model_repository, photos
) -> None:
    inference = _inference()
    replica = await inference.replica_id.remote()
    assert (await inference.batching.remote())["max_batch_size"] == 8
    traffic = Traffic(f"127.0.0.1:{port}", photos["chelsea"])
    await traffic.answered(5)
    await asyncio.to_thread(
        _deploy,
        model_repository,
        port,
        max_batch_size=2,
        log_sample_rate=0.0,
        max_queued_images=2048,
    )
    for _ in range(100):
        if (await inference.batching.remote())["max_batch_size"] == 2:
            break
        await asyncio.sleep(0.1)  # polling
    batching = await inference.batching.remote()
    assert batching["max_batch_size"] == 2 and batching["max_queued_images"] == 2048
    assert await inference.replica_id.remote() == replica  # reconfigured, not restarted
    answered = sum(map(len, traffic.answers.values()))
    await traffic.answered(answered + 5)
    await traffic.finish()
    assert traffic.stream_error is None  # the stream never noticed
    assert set(traffic.codes()) == {OK}


async def test_a_user_config_the_engine_cannot_take_is_refused_and_the_replica_keeps_serving(
    port, model_repository, photos
) -> None:
    """max_batch_size over the engine's maximum (64): before, the replica's reconfigure
    raised, Serve replaced it with replicas that all failed, and nothing served."""
    inference = _inference()
    replica = await inference.replica_id.remote()
    before = await inference.batching.remote()
    traffic = Traffic(f"127.0.0.1:{port}", photos["chelsea"])
    await traffic.answered(5)
    await asyncio.to_thread(
        _deploy, model_repository, port, max_batch_size=1000, log_sample_rate=0.0
    )
    for _ in range(100):
        if (await inference.batching.remote())["refused"]:
            break
        await asyncio.sleep(0.1)  # polling
    batching = await inference.batching.remote()
    assert "max_batch_size must be at most the engine's 64, got 1000" in batching["refused"]
    assert batching["max_batch_size"] == before["max_batch_size"]
    assert await inference.replica_id.remote() == replica
    answered = sum(map(len, traffic.answers.values()))
    await traffic.answered(answered + 5)
    await traffic.finish()
    assert traffic.stream_error is None and set(traffic.codes()) == {OK}


async def test_a_restarting_redeploy_drains_old_streams_onto_the_new_replica(
    port, model_repository, photos
) -> None:
    old = await _inference().replica_id.remote()
    address = f"127.0.0.1:{port}"
    traffic = Traffic(address, photos["chelsea"], reconnect=False)
    reconnecting = Traffic(address, photos["chelsea"])  # the client's default
    await traffic.answered(5)
    await reconnecting.answered(5)
    # New args change the application's code version: every replica is replaced.
    await asyncio.to_thread(_deploy, model_repository, port, max_batch_size=2, log_sample_rate=0.5)
    await traffic.ended(90)  # the old ingress ends the stream
    assert traffic.stream_error is not None
    assert traffic.stream_error.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in traffic.stream_error.details()
    codes = traffic.codes()
    assert set(codes) <= {OK, UNAVAILABLE} and codes[OK] >= 5
    # The reconnecting stream went on past the old ingress, on the new one, losing nothing.
    await asyncio.wait_for(reconnecting.answered(len(reconnecting.sent) + 10), 60)
    await reconnecting.finish()
    assert reconnecting.stream_error is None
    assert set(reconnecting.codes()) == {OK}
    # The same port now reaches the new replicas.
    async with Client(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout=60)
        response = await client.classify_once([photos["coffee"]])
    assert response.error.code == OK
    assert await _inference().replica_id.remote() != old


async def test_deleting_the_app_answers_every_request_then_refuses_calls(port, photos) -> None:
    from ray import serve

    # Reconnecting, with no server to come back: the stream gives up after connect_timeout.
    traffic = Traffic(f"127.0.0.1:{port}", photos["chelsea"], connect_timeout=2.0)
    await traffic.answered(5)
    await asyncio.to_thread(serve.delete, APP)
    await traffic.finish()
    codes = traffic.codes()
    assert set(codes) <= {OK, UNAVAILABLE} and codes[OK] >= 5
    assert traffic.stream_error is not None
    assert traffic.stream_error.code() == grpc.StatusCode.UNAVAILABLE
    async with Client(f"127.0.0.1:{port}") as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.classify_once([photos["coffee"]])
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
