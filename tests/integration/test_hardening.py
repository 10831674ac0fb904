"""What a hostile or careless client can do to a real server at default settings: stop
reading its answers, send huge request ids, send images that are expensive to decode,
send an image whose header is valid but whose content PIL refuses. Real Ray Serve, real gRPC,
real image bytes; the engine is `echo` (these tests are about decode and transport), in the
default topology (chained)."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

from conftest import encode, start_app

pytestmark = pytest.mark.slow
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
STAGE_DEPLOYMENTS = ("Preprocess", "Inference", "Postprocess")  # topology chained


@pytest.fixture(scope="module")
def hardened(ray_cluster, model_repository):
    from ray import serve

    port, handle = start_app("hardening", model_repository, engine={"kind": "echo"})
    yield f"127.0.0.1:{port}", handle
    serve.delete("hardening")


def _heavy_png() -> bytes:
    """A 16-bit greyscale PNG of 16 megapixels: 33 KB on the wire, ~0.5 s to decode."""
    row = np.arange(4000, dtype=np.uint16) * 16
    buffer = io.BytesIO()
    Image.fromarray(np.tile(row, (4000, 1))).save(buffer, "PNG")
    return buffer.getvalue()


async def test_a_client_that_stops_reading_stops_the_server_reading_its_stream(
    hardened, photos
) -> None:
    """Answers of ~100 KB each (top_k 1000 for four images) to a client that never reads
    them: the server stops reading the stream at its bound (64 requests in flight) plus what
    gRPC buffers, instead of reading and answering all 1,000 into memory."""
    address, handle = hardened
    tiny = encode(np.full((32, 32, 3), 128, np.uint8))
    before = await handle.requests_started.remote()
    sent = 0

    async def requests():
        nonlocal sent
        for i in range(1000):
            sent += 1
            yield pb.ClassifyRequest(request_id=str(i), images=[tiny] * 4, top_k=1000)

    # No BDP probing: the client's HTTP/2 window stays at its initial 64 KiB, so what gRPC
    # itself buffers is one answer; with it, the window grows with the connection's
    # bandwidth-delay product and the server may send a few hundred more answers first.
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = pb_grpc.ImageClassifierStub(channel).Classify(requests())
        started, stable = -1, 0
        while stable < 10:  # the count of requests the server took, still for 2 s
            await asyncio.sleep(0.2)  # polling: the count must hold still
            now = await handle.requests_started.remote() - before
            stable, started = (stable + 1, now) if now == started else (0, now)
        assert started < 200, f"the server took {started} of {sent} requests"
        # Reading again, the client gets every answer, exactly once.
        answers = [await call.read() for _ in range(1000)]
        assert sorted(int(a.request_id) for a in answers) == list(range(1000))
        assert all(a.error.code == 0 for a in answers)
        call.cancel()


async def test_an_over_long_request_id_is_refused_with_a_clipped_echo(hardened, photos) -> None:
    """A 4 MiB id sent twice: before, the duplicate answer echoed it and the stream died."""
    address, _ = hardened
    long_id = "x" * (4 << 20)
    requests = [
        pb.ClassifyRequest(request_id=long_id, images=[photos["chelsea"]]),
        pb.ClassifyRequest(request_id=long_id, images=[photos["chelsea"]]),
        pb.ClassifyRequest(request_id="fine", images=[photos["chelsea"]]),
    ]
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.ImageClassifierStub(channel).Classify(iter(requests))
        answers = [answer async for answer in call]
    assert len(answers) == 3
    refused = [a for a in answers if a.request_id != "fine"]
    assert [a.error.code for a in refused] == [INVALID_ARGUMENT] * 2
    assert all(a.request_id == "x" * 256 for a in refused)
    assert "over the limit of 256" in refused[0].error.message
    assert next(a for a in answers if a.request_id == "fine").error.code == 0


async def test_expensive_images_on_one_stream_do_not_hold_another_streams_photo(
    hardened, photos
) -> None:
    """Stream A sends two requests of four 16-megapixel PNGs (seconds of decoding); stream B
    then sends one photo. B is answered before A's first request: before, B's photo waited
    in the decode queue behind all of A's images."""
    address, _ = hardened
    heavy = _heavy_png()
    order: list[str] = []
    async with (
        grpc.aio.insecure_channel(address) as channel_a,
        grpc.aio.insecure_channel(address) as channel_b,
    ):
        a = pb_grpc.ImageClassifierStub(channel_a).Classify()
        for name in ("a1", "a2"):
            await a.write(pb.ClassifyRequest(request_id=name, images=[heavy] * 4))
        await a.done_writing()

        async def read_a() -> None:
            async for answer in a:
                assert answer.error.code == 0 and all(r.labels for r in answer.results)
                order.append(answer.request_id)

        reader = asyncio.ensure_future(read_a())
        await asyncio.sleep(0.3)  # A's requests are read and decoding
        b = pb_grpc.ImageClassifierStub(channel_b).ClassifyOnce
        answer = await b(pb.ClassifyRequest(request_id="b", images=[photos["chelsea"]]))
        assert answer.error.code == 0
        order.append("b")
        await asyncio.wait_for(reader, 120)
    assert order[0] == "b", order


async def test_an_image_pil_refuses_says_what_is_wrong(hardened) -> None:
    """skimage's multi-page RGB TIFF (planar layout): before, "no ... TIFF header found"."""
    import skimage

    tiff = (Path(skimage.data.__file__).parent / "multipage_rgb.tif").read_bytes()
    async with grpc.aio.insecure_channel(hardened[0]) as channel:
        answer = await pb_grpc.ImageClassifierStub(channel).ClassifyOnce(
            pb.ClassifyRequest(images=[tiff])
        )
    error = answer.results[0].error
    assert error.code == INVALID_ARGUMENT
    assert "TIFF image that cannot be decoded (unknown pixel mode)" in error.message


async def test_a_message_that_is_not_a_request_fails_alone(hardened, photos) -> None:
    """Bytes that do not parse as a ClassifyRequest get INVALID_ARGUMENT in their own answer;
    the requests around them are answered and the stream goes on."""
    one, two = (
        pb.ClassifyRequest(request_id=name, images=[photos["coffee"]]).SerializeToString()
        for name in ("one", "two")
    )
    async with grpc.aio.insecure_channel(hardened[0]) as channel:
        classify = channel.stream_stream(
            "/raystream.v1.ImageClassifier/Classify",
            request_serializer=None,
            response_deserializer=pb.ClassifyResponse.FromString,
        )
        answers = [a async for a in classify(iter([one, b"\xff" * 5, two]))]
    by_id = {a.request_id: a for a in answers}
    assert len(answers) == 3 and set(by_id) == {"one", "two", ""}
    assert by_id[""].error.code == INVALID_ARGUMENT
    assert "not a raystream.v1.ClassifyRequest" in by_id[""].error.message
    assert by_id["one"].error.code == 0 and by_id["two"].error.code == 0


async def test_a_message_that_is_not_a_request_is_refused_on_every_inference_call(
    hardened, photos
) -> None:
    """The same bytes on ClassifyOnce, OIP ModelInfer and OIP ModelStreamInfer: refused as
    INVALID_ARGUMENT each in its protocol's way, and the OIP stream goes on (gRPC's own
    parse answered UNKNOWN, and ended the stream)."""
    from raystream.oip import grpc_predict_v2_pb2 as oip

    junk = b"\xff" * 5
    request = oip.ModelInferRequest(
        id="good",
        model_name="efficientnet-lite0",
        inputs=[
            oip.ModelInferRequest.InferInputTensor(
                name="images",
                datatype="BYTES",
                shape=[1],
                contents=oip.InferTensorContents(bytes_contents=[photos["coffee"]]),
            )
        ],
    ).SerializeToString()
    async with grpc.aio.insecure_channel(hardened[0]) as channel:
        once = channel.unary_unary(
            "/raystream.v1.ImageClassifier/ClassifyOnce", None, pb.ClassifyResponse.FromString
        )
        answer = await once(junk)
        assert answer.error.code == INVALID_ARGUMENT
        assert "not a raystream.v1.ClassifyRequest" in answer.error.message
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer", None, oip.ModelInferResponse.FromString
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer(junk)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not an inference.ModelInferRequest" in refused.value.details()
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            None,
            oip.ModelStreamInferResponse.FromString,
        )
        answers = [a async for a in stream(iter([junk, request]))]
    errors = sorted(a.error_message for a in answers)
    assert len(answers) == 2 and errors[0] == ""  # "good" answered
    assert errors[1].startswith("INVALID_ARGUMENT: message is not an inference.ModelInferRequest")


@pytest.mark.parametrize(
    "method",
    ["/raystream.v1.ImageClassifier/GetModelInfo", "/inference.GRPCInferenceService/ModelMetadata"],
)
async def test_a_message_that_is_not_a_request_is_refused_by_the_metadata_calls(
    hardened, method
) -> None:
    async with grpc.aio.insecure_channel(hardened[0]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary(method)(b"\xff" * 5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message is not a " in refused.value.details()


def test_an_oip_shape_with_a_negative_size_is_refused() -> None:
    """[-1, -1] once counted as one element (its product), so it passed for one image."""
    from raystream.oip import grpc_predict_v2_pb2 as oip
    from serve_app.errors import InvalidArgument
    from serve_app.protocol.oip import _images

    tensor = oip.ModelInferRequest.InferInputTensor(name="images", datatype="BYTES", shape=[-1, -1])
    tensor.contents.bytes_contents.append(b"x")
    with pytest.raises(InvalidArgument, match="negative size"):
        _images(oip.ModelInferRequest(inputs=[tensor]))


@pytest.mark.parametrize(
    ("shape", "raw", "typed", "refusal"),
    [
        ([1, 2], 0, 2, r"shape \[N\] or \[N, 1\]"),  # once read as 2 images
        ([], 0, 1, r"shape \[N\] or \[N, 1\]"),
        ([1, 1, 1], 0, 1, r"shape \[N\] or \[N, 1\]"),
        ([1], 2, 0, "2 raw_input_contents entries"),  # the second once ignored
        ([1], 1, 1, "both raw_input_contents and typed contents"),
    ],
)
def test_an_oip_images_input_of_another_layout_is_refused(shape, raw, typed, refusal) -> None:
    """OIP's `images` is [N] or [N, 1] BYTES, in raw or typed contents, not both."""
    from raystream.oip import grpc_predict_v2_pb2 as oip
    from serve_app.errors import InvalidArgument
    from serve_app.protocol.oip import _images

    tensor = oip.ModelInferRequest.InferInputTensor(name="images", datatype="BYTES", shape=shape)
    tensor.contents.bytes_contents.extend([b"x"] * typed)
    element = len(b"x").to_bytes(4, "little") + b"x"
    request = oip.ModelInferRequest(inputs=[tensor], raw_input_contents=[element] * raw)
    with pytest.raises(InvalidArgument, match=refusal):
        _images(request)
    tensor.shape[:] = [2, 1]
    request = oip.ModelInferRequest(inputs=[tensor], raw_input_contents=[element * 2])
    del request.inputs[0].contents.bytes_contents[:]
    assert _images(request) == (b"x", b"x")  # [N, 1] in raw contents: N images


def _oip_request(images: list[bytes], outputs: list[tuple[str, int]]) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name="efficientnet-lite0", id="r")
    tensor = request.inputs.add(name="images", datatype="BYTES", shape=[len(images)])
    tensor.contents.bytes_contents.extend(images)
    for name, k in outputs:
        output = request.outputs.add(name=name)
        if k:
            output.parameters["classification"].int64_param = k
    return request


async def _memory(app: str, ingress) -> list[int]:
    """Resident bytes of the ingress replica and of each stage deployment's replica."""
    from ray import serve

    stages = [serve.get_deployment_handle(name, app) for name in STAGE_DEPLOYMENTS]
    return [await ingress.memory_bytes.remote()] + [
        await stage.memory_bytes.remote() for stage in stages
    ]


async def test_an_oip_answer_past_the_send_limit_is_refused_before_any_work(
    hardened, photos
) -> None:
    """256 tiny JPEGs asking 1,000 labels under 8 output names (an answer of about 70 MB,
    past the 64 MiB send limit), then `labels` listed 100 times: each refused at once,
    while another client's photo is answered within a second and no process grows. Before,
    the answer was built and carried through every stage before the send refused it
    (with 100 outputs: 675 MB, gigabytes in each process, the other photo 22 s late)."""
    address, handle = hardened
    tiny = encode(np.full((32, 32, 3), 128, np.uint8))
    before = await _memory("hardening", handle)
    started = await handle.requests_started.remote()
    attacks = {
        "over the send limit": [(f"top{i}", 1000) for i in range(8)],
        "listed 100 times": [("labels", 1000)] * 100,
    }
    async with (
        grpc.aio.insecure_channel(address) as attacker,
        grpc.aio.insecure_channel(address) as other,
    ):
        infer = oip_grpc.GRPCInferenceServiceStub(attacker).ModelInfer
        other_infer = oip_grpc.GRPCInferenceServiceStub(other).ModelInfer

        async def timed(call, request) -> tuple[float, grpc.aio.AioRpcError | None]:
            begin = time.perf_counter()
            try:
                await call(request)
            except grpc.aio.AioRpcError as exc:
                return time.perf_counter() - begin, exc
            return time.perf_counter() - begin, None

        for (why, outputs), expected in zip(
            attacks.items(), ("answer could reach", "100 outputs requested"), strict=True
        ):
            attack = asyncio.ensure_future(timed(infer, _oip_request([tiny] * 256, outputs)))
            await asyncio.sleep(0.05)  # the attack is on its way
            photo = _oip_request([photos["chelsea"]], [("labels", 1)])
            photo_s, photo_failed = await timed(other_infer, photo)
            attack_s, refused = await attack
            assert photo_failed is None and photo_s < 1.0, (why, photo_s, photo_failed)
            assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT, why
            assert expected in refused.details() and attack_s < 1.0, (why, attack_s)
    assert await handle.requests_started.remote() == started + 2  # the photos alone
    after = await _memory("hardening", handle)
    grown = [now - was for now, was in zip(after, before, strict=True)]
    assert max(grown) < 100 << 20, grown


async def test_an_oip_output_requested_twice_is_answered_once(hardened, photos) -> None:
    """As raystream.v1 collapses repeated outputs; the same name with another
    `classification` is refused. Before, each listing made a tensor of its own."""
    async with grpc.aio.insecure_channel(hardened[0]) as channel:
        infer = oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        twice = [("labels", 3), ("probabilities", 0), ("labels", 3), ("probabilities", 0)]
        reply = await infer(_oip_request([photos["coffee"]], twice))
        assert [(o.name, list(o.shape)) for o in reply.outputs] == [
            ("labels", [1, 3]),
            ("probabilities", [1, 1000]),
        ]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer(_oip_request([photos["coffee"]], [("labels", 3), ("labels", 5)]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'labels' requested twice with different parameters" in refused.value.details()


async def test_model_control_is_off_by_default(hardened, photos) -> None:
    """Loads and unloads are refused, saying how to turn them on, and the model keeps
    serving. Before, any client that could infer could unload the model served."""
    model = "efficientnet-lite0"
    async with grpc.aio.insecure_channel(hardened[0]) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        for call, request in (
            (stub.RepositoryModelUnload, oip.RepositoryModelUnloadRequest(model_name=model)),
            (stub.RepositoryModelLoad, oip.RepositoryModelLoadRequest(model_name=model)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model_control: {token_file:" in refused.value.details()
        assert (await stub.ModelReady(oip.ModelReadyRequest(name=model))).ready
        reply = await stub.ModelInfer(_oip_request([photos["coffee"]], [("labels", 1)]))
        assert list(reply.outputs[0].shape) == [1, 1]
