"""The Open Inference Protocol (KServe v2) service on the real app, through stubs generated
from the standard grpc_predict_v2 field layout: a standard client's view of raystream."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest

from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc

pytestmark = pytest.mark.slow
CATS = range(281, 286)


def _raw_bytes(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _request(images: list[bytes], outputs=None, request_id: str = "r") -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name="efficientnet-lite0", id=request_id)
    request.inputs.add(name="images", datatype="BYTES", shape=[len(images)])
    request.raw_input_contents.append(_raw_bytes(images))
    for name, k in outputs or []:
        output = request.outputs.add(name=name)
        if k:
            output.parameters["classification"].int64_param = k
    return request


async def test_model_infer_returns_probabilities_and_labels(server, photos) -> None:
    async with grpc.aio.insecure_channel(server) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        assert (await stub.ServerLive(oip.ServerLiveRequest())).live
        assert (await stub.ServerReady(oip.ServerReadyRequest())).ready
        assert (await stub.ModelReady(oip.ModelReadyRequest(name="efficientnet-lite0"))).ready
        meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name="efficientnet-lite0"))
        assert meta.inputs[0].datatype == "BYTES" and list(meta.outputs[0].shape) == [-1, 1000]
        assert list(meta.inputs[0].shape) == [-1, 1]  # as ModelConfig's dims [1]: perf_analyzer

        reply = await stub.ModelInfer(
            _request(
                [photos["chelsea"], photos["coffee"]], outputs=[("probabilities", 0), ("labels", 3)]
            )
        )
        assert reply.id == "r" and [o.name for o in reply.outputs] == ["probabilities", "labels"]
        probs = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, 1000)
        assert probs[0].argmax() in CATS and probs[1].argmax() in {967, 968, 504}
        assert abs(probs.sum(axis=1) - 1).max() < 1e-3
        raw, labels = reply.raw_output_contents[1], []
        while raw:
            (size,) = struct.unpack_from("<I", raw)
            labels.append(raw[4 : 4 + size].decode())
            raw = raw[4 + size :]
        assert len(labels) == 6 and int(labels[0].split(":")[1]) == probs[0].argmax()
        assert abs(float(labels[0].split(":")[0]) - probs[0].max()) < 1e-5
        # no images: an empty probabilities tensor, not an error
        empty = await stub.ModelInfer(_request([]))
        assert list(empty.outputs[0].shape) == [0, 1000] and empty.raw_output_contents[0] == b""


async def test_errors_follow_the_protocol(server, photos) -> None:
    async with grpc.aio.insecure_channel(server) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ModelInfer(_request([photos["coffee"], b"junk"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "image 1" in err.value.details()
        wrong = _request([photos["coffee"]])
        wrong.model_name = "resnet9000"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ModelInfer(wrong)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # a negative k named no labels and declared a tensor of shape [N, -3]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ModelInfer(_request([photos["coffee"]], outputs=[("labels", -3)]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "classification must be 1 or more" in err.value.details()
        # The stream answers each request, the bad one with its error, and goes on.
        replies = [
            r
            async for r in stub.ModelStreamInfer(
                iter(
                    [
                        _request([photos["chelsea"]], request_id="a"),
                        _request([b"junk"], request_id="b"),
                        _request([photos["coffee"]], request_id="c"),
                    ]
                )
            )
        ]
        by_id = {r.infer_response.id: r for r in replies}  # completion order: see test_streams
        assert len(replies) == 3 and sorted(by_id) == ["a", "b", "c"]
        assert [bool(by_id[i].error_message) for i in "abc"] == [False, True, False]
        assert by_id["b"].error_message.startswith("INVALID_ARGUMENT")


async def test_preprocessed_fp32_input_gives_the_same_scores(server, photos, model) -> None:
    """A client that preprocesses itself (decode, resize, crop, normalize, NCHW) sends input
    `pixels`; the scores equal those of the encoded-image path."""
    from engines.base import normalize
    from engines.images import decode

    spec = model.spec.preprocess
    crops = np.stack([decode(photos[name], spec) for name in ("chelsea", "coffee")])
    pixels = normalize(crops, spec.mean_array, spec.std_array)
    request = oip.ModelInferRequest(model_name="efficientnet-lite0", id="p")
    request.inputs.add(name="pixels", datatype="FP32", shape=list(pixels.shape))
    request.raw_input_contents.append(pixels.astype("<f4").tobytes())
    async with grpc.aio.insecure_channel(server) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name="efficientnet-lite0"))
        assert [(i.name, i.datatype) for i in meta.inputs] == [
            ("images", "BYTES"),
            ("pixels", "FP32"),
        ]
        from_pixels = await stub.ModelInfer(request)
        from_bytes = await stub.ModelInfer(_request([photos["chelsea"], photos["coffee"]]))
        ours = np.frombuffer(from_pixels.raw_output_contents[0], np.float32).reshape(2, 1000)
        theirs = np.frombuffer(from_bytes.raw_output_contents[0], np.float32).reshape(2, 1000)
        assert ours[0].argmax() in CATS and np.abs(ours - theirs).max() < 1e-4
        wrong = oip.ModelInferRequest(model_name="efficientnet-lite0", id="w")
        wrong.inputs.add(name="pixels", datatype="FP32", shape=[1, 3, 100, 100])
        wrong.raw_input_contents.append(np.zeros((1, 3, 100, 100), "<f4").tobytes())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ModelInfer(wrong)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "[N, 3, 224, 224]" in err.value.details()


async def test_embedding_output(server, photos, torch_embedding) -> None:
    """Output `embedding`: FP32 [N, 1280], each row the torch model's vector (norm 1),
    requestable beside the other outputs, on ModelInfer and ModelStreamInfer; ModelMetadata
    lists it."""
    from conftest import cosines

    images = [photos["chelsea"], photos["coffee"]]
    async with grpc.aio.insecure_channel(server) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name="efficientnet-lite0"))
        assert [(o.name, o.datatype, list(o.shape)) for o in meta.outputs][2:] == [
            ("embedding", "FP32", [-1, 1280]),
            ("embedding_fp16", "FP16", [-1, 1280]),
        ]
        reply = await stub.ModelInfer(_request(images, outputs=[("labels", 1), ("embedding", 0)]))
        assert [(o.name, o.datatype, list(o.shape)) for o in reply.outputs] == [
            ("labels", "BYTES", [2, 1]),
            ("embedding", "FP32", [2, 1280]),
        ]
        vectors = np.frombuffer(reply.raw_output_contents[1], "<f4").reshape(2, 1280)
        assert cosines(vectors, torch_embedding(images)).min() >= 0.9999
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        (streamed,) = [
            r
            async for r in stub.ModelStreamInfer(
                iter([_request(images[:1], outputs=[("embedding", 0)], request_id="s")])
            )
        ]
        assert not streamed.error_message
        one = np.frombuffer(streamed.infer_response.raw_output_contents[0], "<f4")
        assert cosines(one[None], vectors[:1])[0] >= 0.9999
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ModelInfer(_request(images, outputs=[("embeddings", 0)]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outputs: probabilities, labels, embedding" in err.value.details()
