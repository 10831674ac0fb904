"""Overload: past the inference queue's bound, requests are refused at once with
RESOURCE_EXHAUSTED in their own response; everything is answered and the server recovers."""

from __future__ import annotations

import asyncio

import pytest

from clients.client import Client
from raystream.v1 import classifier_pb2 as pb

from conftest import deploy_app, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_queue_server(ray_cluster, model_repository):
    from ray import serve

    port = free_port()
    deploy_app(
        {
            "name": "overload",
            "route_prefix": None,
            "import_path": "serve_app.app:build_app",
            "args": {
                "port": port,
                "model_repository": str(model_repository),
                "topology": "fused",
                "engine": {"kind": "onnxruntime"},
            },
            "deployments": [
                {
                    "name": "Inference",
                    "user_config": {"max_batch_size": 16, "max_queued_images": 16},
                }
            ],
        }
    )
    yield f"127.0.0.1:{port}"
    serve.delete("overload")


async def test_flood_is_refused_fast_and_nothing_is_lost(small_queue_server, photos) -> None:
    async def one_stream(index: int) -> list[pb.ClassifyResponse]:
        requests = [
            pb.ClassifyRequest(request_id=f"{index}-{i}", images=[photos["chelsea"]] * 8)
            for i in range(12)
        ]
        async with Client(small_queue_server) as client:
            return [r async for r in client.stream(requests)]

    streams = await asyncio.gather(*(one_stream(i) for i in range(4)))
    responses = [r for stream in streams for r in stream]
    assert len(responses) == 48  # every request answered once
    codes = [r.error.code for r in responses]
    assert set(codes) <= {0, 8} and codes.count(8) > 0 and codes.count(0) > 0
    refused = [r for r in responses if r.error.code == 8]
    assert all("queue is full" in r.error.message for r in refused)
    # Refusals do not wait for the engine: they skip the queue entirely.
    assert max(r.timing.inference_ms for r in refused) == 0.0
    # Once the flood is over, the server serves normally.
    async with Client(small_queue_server) as client:
        response = await client.classify_once([photos["coffee"]])
    assert response.error.code == 0 and response.results[0].labels
