"""The KServe v2 / Open Inference Protocol service (`inference.GRPCInferenceService`) on the
raystream pipeline: the same ingress, validation, batching and errors as raystream.v1.

Model interface:
- input `images`: BYTES, shape [N] (or [N, 1]), one encoded image per element, in
  `raw_input_contents` (4-byte little-endian length before each element) or `bytes_contents`.
- or input `pixels`: FP32 [N, C, H, W] at the model's input size, already preprocessed as the
  model expects (resized, cropped, normalized with its mean/std), raw or `fp32_contents`;
  it skips decoding and batches apart from decoded crops in the inference replica.
- output `probabilities`: FP32 [N, classes], softmax scores (the default output).
- output `labels` (or any requested output with the `classification` parameter k, Triton's
  classification extension): BYTES [N, k], elements "score:class_id:name", best first.
OIP has no per-item errors: a request with a bad image fails as a whole with
INVALID_ARGUMENT naming the image. ModelStreamInfer runs requests concurrently and answers
each in its own ModelStreamInferResponse (completion order, with its `id`), with
`error_message` set when it failed; the stream goes on, and drains on shutdown.
"""

from __future__ import annotations

import struct

import grpc
import numpy as np

from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from raystream.v1 import classifier_pb2 as pb
from serve_app.errors import InvalidArgument, clip
from serve_app.preprocessing import client_pixels

INPUT, SCORES, LABELS = "images", "probabilities", "labels"
PIXELS = "pixels"  # FP32 (N, C, H, W), preprocessed by the client as the model expects


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _bytes_elements(raw: bytes) -> list[bytes]:
    """Triton/OIP raw BYTES: each element is a 4-byte little-endian length, then the bytes."""
    out, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "truncated BYTES tensor")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "truncated BYTES tensor")
        out.append(raw[offset : offset + size])
        offset += size
    return out


def _encode_bytes(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _pixels(request: oip.ModelInferRequest, input_shape: tuple[int, ...]) -> np.ndarray:
    """The FP32 input: (N, C, H, W) with (C, H, W) the model's, from raw or typed contents."""
    tensor = request.inputs[0]
    if tensor.datatype != "FP32":
        raise _Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input {PIXELS!r} must be FP32, got {tensor.datatype}",
        )
    if request.raw_input_contents:
        values = request.raw_input_contents[0]
    else:
        values = np.asarray(tensor.contents.fp32_contents, dtype=np.float32)
    try:
        return client_pixels(tuple(tensor.shape), values, input_shape, PIXELS)
    except InvalidArgument as exc:
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def _images(request: oip.ModelInferRequest) -> list[bytes]:
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise _Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input {INPUT!r} must be BYTES (encoded images), got {tensor.datatype}; send "
            f"preprocessed FP32 tensors as input {PIXELS!r}",
        )
    if request.raw_input_contents:
        images = _bytes_elements(request.raw_input_contents[0])
    else:
        images = list(tensor.contents.bytes_contents)
    expected = int(np.prod(tensor.shape)) if tensor.shape else len(images)
    if len(images) != expected:
        raise _Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input shape {list(tensor.shape)} holds {expected} elements, got {len(images)}",
        )
    return images


def _top_k(request: oip.ModelInferRequest) -> dict[str, int]:
    """Requested outputs -> how many labels each needs (0: the probabilities of all classes)."""
    wanted = {}
    for output in request.outputs or [
        oip.ModelInferRequest.InferRequestedOutputTensor(name=SCORES)
    ]:
        k = (
            output.parameters["classification"].int64_param
            if ("classification" in output.parameters)
            else 0
        )
        if output.name == SCORES and not k:
            wanted[SCORES] = 0
        elif output.name == LABELS or k:
            wanted[output.name] = k or 5
        else:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown output {clip(output.name)!r}; outputs: {SCORES}, {LABELS}",
            )
    return wanted


class OpenInferenceService(oip_grpc.GRPCInferenceServiceServicer):
    def __init__(self, classifier) -> None:
        self._classifier = classifier  # serve_app.classifier.ClassifierService
        self._name, self._version, self._engine = classifier.model

    def _check_model(self, name: str, version: str = "") -> None:
        if name != self._name or version not in ("", self._version):
            raise _Rejected(
                grpc.StatusCode.NOT_FOUND,
                f"model {clip(name)!r} version {clip(version)!r} is not served here; this "
                f"server serves {self._name!r} version {self._version!r}",
            )

    async def _infer(self, request: oip.ModelInferRequest, context) -> oip.ModelInferResponse:
        self._check_model(request.model_name, request.model_version)
        names = [i.name for i in request.inputs]
        if names not in ([INPUT], [PIXELS]):
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"expected one input tensor, {INPUT!r} (BYTES) or {PIXELS!r} (FP32), "
                f"got {clip(str(names))}",
            )
        wanted = _top_k(request)
        top_k, scores = max(wanted.values()) or 1, 0 in wanted.values()
        if names == [PIXELS]:
            answer, probabilities = await self._classifier.respond(
                pb.ClassifyRequest(request_id=request.id, top_k=top_k),
                context,
                pixels=_pixels(request, self._engine.input_shape),
                scores=scores,
            )
        else:
            answer, probabilities = await self._classifier.respond(
                pb.ClassifyRequest(request_id=request.id, images=_images(request), top_k=top_k),
                context,
                scores=scores,
            )
        if answer.error.code:
            raise _Rejected(_status(answer.error.code), answer.error.message)
        for i, result in enumerate(answer.results):
            if result.error.code:
                raise _Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT, f"image {i}: {result.error.message}"
                )
        response = oip.ModelInferResponse(
            model_name=self._name, model_version=self._version, id=answer.request_id
        )
        n = len(answer.results)
        for name, k in wanted.items():
            if k == 0:  # every class's probability
                if probabilities is None:  # no images, so no rows
                    probabilities = np.zeros((0, self._engine.num_classes), np.float32)
                response.outputs.add(name=name, datatype="FP32", shape=list(probabilities.shape))
                response.raw_output_contents.append(probabilities.astype("<f4").tobytes())
            else:
                elements = [
                    f"{lb.score:f}:{lb.class_id}:{lb.name}".encode()
                    for result in answer.results
                    for lb in result.labels[:k]
                ]
                response.outputs.add(name=name, datatype="BYTES", shape=[n, k])
                response.raw_output_contents.append(_encode_bytes(elements))
        return response

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request, context)
        except _Rejected as exc:
            await context.abort(exc.code, str(exc))

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests run concurrently (as on raystream.v1's stream) and are answered in
        completion order, each with its `id`; a failed one gets `error_message`."""

        async def answer(request: oip.ModelInferRequest) -> oip.ModelStreamInferResponse:
            try:
                response = await self._infer(request, context)
                return oip.ModelStreamInferResponse(infer_response=response)
            except _Rejected as exc:
                return oip.ModelStreamInferResponse(
                    error_message=f"{exc.code.name}: {exc}",
                    infer_response=oip.ModelInferResponse(
                        id=self._classifier.request_id(request.id)
                    ),
                )

        async for response in self._classifier.serve_stream(
            request_iterator, context, answer, size=oip.ModelInferRequest.ByteSize
        ):
            yield response

    # Probes answer without a token when token auth is on (serve_app/security.py), as the
    # grpc.health.v1 service does.
    async def ServerLive(self, request, context):
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        """False once the server drains (shutdown): balancers stop sending new work."""
        return oip.ServerReadyResponse(ready=not self._classifier.draining)

    async def ModelReady(self, request, context):
        ready = request.name == self._name and request.version in ("", self._version)
        return oip.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(
            name="raystream", version="0.1.0", extensions=["classification", "model_stream_infer"]
        )

    async def ModelMetadata(self, request, context):
        try:
            self._check_model(request.name, request.version)
        except _Rejected as exc:
            await context.abort(exc.code, str(exc))
        tensor = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=self._name,
            versions=[self._version],
            platform=f"raystream_{self._engine.engine}",
            inputs=[
                tensor(name=INPUT, datatype="BYTES", shape=[-1]),
                tensor(name=PIXELS, datatype="FP32", shape=[-1, *self._engine.input_shape]),
            ],
            outputs=[
                tensor(name=SCORES, datatype="FP32", shape=[-1, self._engine.num_classes]),
                tensor(name=LABELS, datatype="BYTES", shape=[-1, -1]),
            ],
        )


def _status(code: int) -> grpc.StatusCode:
    return next(s for s in grpc.StatusCode if s.value[0] == code)
