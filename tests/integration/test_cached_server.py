"""The result cache end to end: real Ray Serve (topology chained), the real model, real photos
over real gRPC, with `cache.enabled`."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from clients.client import Client
from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from raystream.v1 import classifier_pb2 as pb
from serve_app import tuning

from conftest import start_app

pytestmark = pytest.mark.slow
APP = "cached"


@pytest.fixture(scope="module")
def cached_server(ray_cluster, model_repository):
    from ray import serve

    port, _ = start_app(
        APP,
        model_repository,
        topology="chained",
        engine={"kind": "onnxruntime"},
        cache={"max_bytes": 1 << 20},
    )
    yield f"127.0.0.1:{port}"
    serve.delete(APP)


async def _images_inferred() -> int:
    from ray import serve

    return await serve.get_deployment_handle("Inference", APP).images_inferred.remote()


def _hits(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ray_raystream_cache_image_total{") and 'result="hit"' in line
    )


def _answer(response: pb.ClassifyResponse) -> pb.ClassifyResponse:
    """`response` without its request_id and timing."""
    response = pb.ClassifyResponse.FromString(response.SerializeToString())
    response.ClearField("timing")
    response.ClearField("request_id")
    return response


async def test_repeated_images_are_answered_from_the_cache(
    cached_server, photos, metrics_url
) -> None:
    hits_before = await asyncio.to_thread(_hits, metrics_url)
    images = [photos["chelsea"], b"junk", photos["coffee"]]
    asked = {"top_k": 3, "outputs": [pb.LABELS, pb.EMBEDDING]}
    async with Client(cached_server) as client:
        first = await client.classify_once(pb.ClassifyRequest(images=images, **asked))
        inferred = await _images_inferred()
        # Streamed: the images stay spans of the message (serve_app/wire/request_images.py), and
        # the junk image, never cached, goes to the stages again picked out of them
        requests = [pb.ClassifyRequest(request_id=str(i), images=images, **asked) for i in range(3)]
        assert requests[0].ByteSize() >= tuning.SPLIT_MIN_BYTES
        again = sorted([r async for r in client.stream(requests)], key=lambda r: r.request_id)
        # The same photos with other outputs asked: other keys, so the engine runs them
        labels_only = await client.classify_once(pb.ClassifyRequest(images=images, top_k=3))
    assert first.results[0].labels[0].class_id in range(281, 286)  # a cat
    assert first.results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for i, response in enumerate(again):
        assert response.request_id == str(i) and _answer(response) == _answer(first)
        assert response.timing.total_ms > 0
    assert await _images_inferred() == inferred + 2  # labels_only's two photos, no repeat
    assert [r.labels for r in labels_only.results] == [r.labels for r in first.results]
    assert not labels_only.results[0].HasField("embedding")

    for _ in range(60):  # Ray's agent exports every second
        hits = await asyncio.to_thread(_hits, metrics_url)
        if hits - hits_before >= 6:
            break
        await asyncio.sleep(0.5)  # polling
    assert hits - hits_before >= 6  # two photos, three times


async def test_oip_answers_from_the_cache_equal_the_first(cached_server, photos) -> None:
    tensor = oip.ModelInferRequest.InferInputTensor(name="images", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend([photos["rocket"], photos["astronaut"]])
    request = oip.ModelInferRequest(
        model_name="efficientnet-lite0",
        inputs=[tensor],
        outputs=[
            oip.ModelInferRequest.InferRequestedOutputTensor(name="probabilities"),
            oip.ModelInferRequest.InferRequestedOutputTensor(name="embedding"),
        ],
    )
    async with grpc.aio.insecure_channel(cached_server) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        first = await stub.ModelInfer(request)
        inferred = await _images_inferred()
        second = await stub.ModelInfer(request)
    assert await _images_inferred() == inferred
    assert second == first and [list(o.shape) for o in first.outputs] == [[2, 1000], [2, 1280]]
