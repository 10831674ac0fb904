"""Traces end to end: real Ray Serve (topology chained, stage calls over the replicas'
ports), the real model and photos, and a real OTLP receiver: the collector's gRPC
TraceService and MetricsService on a free loopback port, which the replicas export their
spans and the ingress its latency histogram (with exemplars) to."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from support import OtlpReceiver, until

from clients.client import Client
from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from raystream.v1 import classifier_pb2 as pb
from serve_app.observability.metrics import LATENCY_MS

from conftest import start_app

pytestmark = pytest.mark.slow
APP = "traced"
STAGES = ("Preprocess", "Inference", "Postprocess")
NAME = "raystream_request_duration_ms"  # the Prometheus histogram's name (Ray adds ray_)
STAGE_SPANS = {f"raystream.stage {stage}" for stage in STAGES}


@pytest.fixture(scope="module")
async def receiver():
    found = await OtlpReceiver().start()
    yield found
    await found.stop()


@pytest.fixture(scope="module")
def traced_server(ray_cluster, model_repository, receiver):
    """Sample ratio 0: only requests whose client sends a sampled traceparent are traced."""
    from ray import serve

    port, _ = start_app(
        APP,
        model_repository,
        topology="chained",
        stage_ports=(9100, 9163),
        engine={"kind": "onnxruntime"},
        # spans leave a replica every TRACE_EXPORT_DELAY_S (5 s): the tests wait up to 60
        tracing={"sample_ratio": 0.0, "otlp_endpoint": receiver.endpoint},
    )
    yield f"127.0.0.1:{port}"
    serve.delete(APP)


@pytest.fixture(scope="module")
async def over_ports(traced_server, photos) -> str:
    """The server once its stage calls go over the ports (the ingress reads the replicas'
    addresses every second; before, calls go by handle)."""
    from ray import serve

    postprocess = serve.get_deployment_handle("Postprocess", app_name=APP)
    async with Client(traced_server) as client:
        for _ in range(40):
            await client.classify_once([photos["coffee"]])
            if await postprocess.port_calls.remote():
                return traced_server
            await asyncio.sleep(0.25)  # polling
    raise AssertionError("the stage calls never went over the ports")


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


async def _until_trace(
    receiver: OtlpReceiver, trace_id: str, timeout_s: float = 60.0
) -> list[dict]:
    """The trace once its last process' spans (Postprocess's) have come."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        names = {span["name"] for span in spans}
        if names >= STAGE_SPANS and "raystream.request" in names and "raystream.answer" in names:
            return spans
        await asyncio.sleep(0.1)  # polling
    raise AssertionError(f"trace {trace_id} incomplete: {sorted(s['name'] for s in spans)}")


def _check_tree(spans: list[dict], client_span: str) -> None:
    """One tree: the ingress' request span under the client's span, every other span under
    a span of the trace, the stages in their replicas' processes, in order."""
    by_id = {span["span_id"]: span for span in spans}
    assert len(by_id) == len(spans)
    (root,) = [span for span in spans if span["parent"] not in by_id]
    assert root["name"] == "raystream.request" and root["parent"] == client_span
    assert root["deployment"] == "Ingress"

    def parent(name: str) -> dict:
        (span,) = [s for s in spans if s["name"] == name]
        return by_id[span["parent"]]

    assert parent("raystream.dispatch_wait")["name"] == "raystream.request"
    assert parent("raystream.answer")["name"] == "raystream.request"
    assert parent("raystream.stage_call")["name"] == "raystream.request"
    assert parent("raystream.stage Preprocess")["name"] == "raystream.stage_call"
    assert parent("raystream.decode")["name"] == "raystream.stage Preprocess"
    assert parent("raystream.stage Inference")["name"] == "raystream.stage Preprocess"
    assert parent("raystream.batch_wait")["name"] == "raystream.stage Inference"
    assert parent("raystream.engine")["name"] == "raystream.stage Inference"
    assert parent("raystream.stage Postprocess")["name"] == "raystream.stage Inference"
    where = {s["name"]: (s["deployment"], s["pid"]) for s in spans}
    assert tuple(where[f"raystream.stage {stage}"][0] for stage in STAGES) == STAGES
    assert len({pid for _, pid in where.values()}) == 4  # four processes: ingress and stages
    stage = next(s for s in spans if s["name"] == "raystream.stage Inference")
    assert stage["attributes"]["raystream.transport"].string_value == "port"


async def test_a_client_trace_holds_the_spans_of_every_process(
    over_ports, receiver, photos
) -> None:
    """raystream.v1 (stream and unary) and OIP (unary and stream): each request, sent with a
    traceparent of its own, gets one tree under the client's span."""
    traced_server, sent = over_ports, []
    async with Client(traced_server) as client:
        for _ in range(2):
            header, trace_id, span_id = _traceparent()
            request = pb.ClassifyRequest(images=[photos["chelsea"], photos["coffee"]], top_k=3)
            response = await client.classify_once(request, metadata=((("traceparent", header),)))
            assert response.results[0].labels
            sent.append((trace_id, span_id, 2))
    async with grpc.aio.insecure_channel(traced_server) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        header, trace_id, span_id = _traceparent()
        request = oip.ModelInferRequest(model_name="efficientnet-lite0")
        tensor = request.inputs.add(name="images", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(photos["astronaut"])
        await stub.ModelInfer(request, metadata=(("traceparent", header),))
        sent.append((trace_id, span_id, 1))
        header, trace_id, span_id = _traceparent()
        call = stub.ModelStreamInfer(iter([request]), metadata=(("traceparent", header),))
        async for answer in call:
            assert not answer.error_message
        sent.append((trace_id, span_id, 1))
    for trace_id, span_id, images in sent:
        spans = await _until_trace(receiver, trace_id)
        _check_tree(spans, span_id)
        (decode,) = [s for s in spans if s["name"] == "raystream.decode"]
        assert decode["attributes"]["raystream.images"].int_value == images
        assert decode["attributes"]["raystream.decode"].string_value == "cpu"
        assert decode["attributes"]["raystream.image_bytes"].int_value > 10_000
        (engine,) = [s for s in spans if s["name"] == "raystream.engine"]
        assert engine["attributes"]["raystream.batch_size"].int_value >= images


async def test_unsampled_requests_export_nothing(traced_server, receiver, photos) -> None:
    """Ratio 0 and no traceparent, or a client's unsampled one: no span at all; a sampled
    request sent after them shows that their spans would have arrived by then."""
    unsampled, trace_id, _ = _traceparent(sampled=False)
    async with Client(traced_server) as client:
        request = pb.ClassifyRequest(images=[photos["chelsea"]])
        await client.classify_once(request)
        await client.classify_once(request, metadata=(("traceparent", unsampled),))
        before = len(receiver.spans)
        sampled, marker, _ = _traceparent()
        await client.classify_once(request, metadata=(("traceparent", sampled),))
    await _until_trace(receiver, marker)
    assert not receiver.trace(trace_id)
    assert {span["trace_id"] for span in receiver.spans[before:]} == {marker}


async def test_a_sampled_request_latency_carries_its_trace_id_as_an_exemplar(
    traced_server, receiver, photos
) -> None:
    """The ingress' latency histogram over OTLP: the Prometheus one's name and buckets, every
    request counted, and a sampled request's trace id (its request span) as an exemplar;
    unsampled requests (ratio 0) carry none."""
    header, trace_id, _ = _traceparent()
    request = pb.ClassifyRequest(images=[photos["coffee"]])
    async with Client(traced_server) as client:
        await client.classify_once(request)  # not sampled: counted, no exemplar
        await client.classify_once(request, metadata=(("traceparent", header),))
    spans = await _until_trace(receiver, trace_id)
    (root,) = [span for span in spans if span["name"] == "raystream.request"]

    def exemplar() -> tuple[dict, dict] | None:
        for point in receiver.histogram(NAME):
            for found in point["exemplars"]:
                if found["trace_id"] == trace_id:
                    return point, found
        return None

    await until(lambda: exemplar() is not None, timeout_s=30.0)
    point, found = exemplar()
    assert found["span_id"] == root["span_id"]
    assert 0 < found["value"] <= (root["end_ns"] - root["start_ns"]) / 1e6
    assert point["deployment"] == "Ingress"
    assert point["bounds"] == LATENCY_MS
    assert point["count"] >= 2 and sum(point["bucket_counts"]) == point["count"]
    traced = {span["trace_id"] for span in receiver.spans}
    every = {e["trace_id"] for p in receiver.histogram(NAME) for e in p["exemplars"]}
    assert every <= traced  # only sampled requests leave exemplars
