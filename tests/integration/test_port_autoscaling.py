"""Serve's autoscaler sees the calls over the stage ports (serve_app/pipeline/autoscaling.py): a
load that reaches Inference over its replicas' ports alone, which Serve's own count of requests
never sees, scales the autoscaled deployment up. The engine is the echo engine with a delay
(the test is about the calls between stages): each call holds an Inference replica 50 ms."""

from __future__ import annotations

import asyncio

import pytest

from clients.client import Client
from raystream.v1 import classifier_pb2 as pb
from serve_app.pipeline.autoscaling import POLICY

from conftest import deploy_app, free_port

pytestmark = pytest.mark.slow

APP = "autoscaled-ports"
SMALL = {"ray_actor_options": {"num_cpus": 0.1}}  # beside the other test apps on 4 logical CPUs


@pytest.fixture(scope="module")
def port_server(ray_cluster, model_repository):
    from ray import serve

    port = free_port()
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 0.5,  # busy more than half the time: scale
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
        "upscale_delay_s": 3,
        "downscale_delay_s": 600,
        "policy": {"policy_function": POLICY},
    }
    deploy_app(
        {
            "name": APP,
            "route_prefix": None,
            "import_path": "serve_app.app:build_app",
            "args": {
                "port": port,
                "model_repository": str(model_repository),
                "topology": "chained",
                "stage_ports": [9100, 9163],
                "engine": {"kind": "echo", "options": {"delay_ms": 50}},
            },
            "deployments": [
                {"name": "Ingress", **SMALL},
                {"name": "Preprocess", **SMALL},
                {"name": "Inference", **SMALL, "autoscaling_config": autoscaling},
                {"name": "Postprocess", **SMALL},
            ],
        }
    )
    yield f"127.0.0.1:{port}"
    serve.delete(APP)


def _status(deployment: str):
    from ray import serve

    return serve.status().applications[APP].deployments[deployment]


def _running(deployment: str) -> int:
    return _status(deployment).replica_states.get("RUNNING", 0)


async def test_calls_over_the_ports_scale_the_deployment(port_server, photos) -> None:
    from ray import serve

    inference = serve.get_deployment_handle("Inference", app_name=APP)
    # One request at a time (under the target) until the calls go over the ports.
    async with Client(port_server) as client:
        for _ in range(40):
            response = await client.classify_once([photos["coffee"]])
            assert response.error.code == 0
            if await inference.port_calls.remote():
                break
            await asyncio.sleep(0.25)  # polling
    before = await inference.port_calls.remote()
    assert before > 0
    preprocess = serve.get_deployment_handle("Preprocess", app_name=APP)
    by_handle = await preprocess.handle_calls.remote()  # the calls before the ports were known
    status = _status("Inference")  # one replica, and none on the way
    assert status.status == "HEALTHY" and status.replica_states == {"RUNNING": 1}, status

    async def load(stop: asyncio.Event) -> None:
        async with Client(port_server) as client:
            while not stop.is_set():
                requests = [pb.ClassifyRequest(images=[photos["coffee"]] * 4) for _ in range(8)]
                responses = [r async for r in client.stream(requests)]
                assert [r.error.code for r in responses] == [0] * 8

    stop = asyncio.Event()
    loads = [asyncio.create_task(load(stop)) for _ in range(4)]
    try:
        # The load goes over the port: the one replica answers calls over its port (no
        # second replica can run before the 3 s upscale delay).
        for _ in range(200):
            if await inference.port_calls.remote() >= before + 5:
                break
            await asyncio.sleep(0.05)  # polling
        assert await inference.port_calls.remote() >= before + 5
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while _running("Inference") < 2:
            assert loop.time() < deadline, "Inference did not scale up under calls over its port"
            for task in loads:
                if task.done():
                    task.result()  # a failed load fails the test with its own error
            await asyncio.sleep(0.5)  # polling
        # Serve counts only handle calls as Inference's requests: none came meanwhile, so
        # the scale-up was the policy's, on the calls over the port.
        assert await preprocess.handle_calls.remote() == by_handle
    finally:
        stop.set()
        await asyncio.gather(*loads)
