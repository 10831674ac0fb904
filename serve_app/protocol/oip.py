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
- output `embedding_fp16`: the same as FP16 [N, D], half the bytes (cosine >= 0.9999).
- output `embedding`: FP32 [N, D], each image's L2-normalized embedding (a model exported
  with one; ModelMetadata lists it then).
OIP has no per-item errors: a request with a bad image fails as a whole with
INVALID_ARGUMENT naming the image. ModelStreamInfer runs requests concurrently and answers
each in its own ModelStreamInferResponse (completion order, with its `id`), with
`error_message` set when it failed; the stream goes on, and drains on shutdown.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence

import grpc
import numpy as np

from engines.scores import DEFAULT_TOP_K
from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from serve_app.core.messages import Answer, Job, OipOutput, Served
from serve_app.core.serving import ServingCore
from serve_app.errors import (
    MAX_MESSAGE_CHARS,
    InvalidArgument,
    ModelControlOff,
    RaystreamError,
    clip,
    code_for,
    code_name,
    message_for,
    parsed_or_none,
)
from serve_app.models.lifecycle import ModelLifecycle
from serve_app.models.registry import parse_model_name
from serve_app.observability import tracing
from serve_app.protocol.streams import StreamRunner, TaskStarter
from serve_app.protocol.v1 import budget_s, unary_handler
from serve_app.wire.answers import OIP_EMBEDDING as EMBEDDING
from serve_app.wire.answers import OIP_EMBEDDING_FP16 as EMBEDDING_FP16
from serve_app.wire.answers import OIP_IMAGES as INPUT
from serve_app.wire.answers import OIP_LABELS as LABELS
from serve_app.wire.answers import OIP_PIXELS as PIXELS
from serve_app.wire.answers import OIP_SCORES as SCORES
from serve_app.wire.pixels import client_pixels

SERVICE = "inference.GRPCInferenceService"
NOT_A_REQUEST = "message is not an inference.ModelInferRequest"


def _bytes_elements(raw: bytes) -> list[bytes]:
    """Triton/OIP raw BYTES: each element is a 4-byte little-endian length, then the bytes."""
    out, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidArgument("truncated BYTES tensor")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise InvalidArgument("truncated BYTES tensor")
        out.append(raw[offset : offset + size])
        offset += size
    return out


def _pixels(request: oip.ModelInferRequest, input_shape: tuple[int, ...]) -> np.ndarray:
    """The FP32 input: (N, C, H, W) with (C, H, W) the model's, from raw or typed contents."""
    tensor = request.inputs[0]
    if tensor.datatype != "FP32":
        raise InvalidArgument(f"input {PIXELS!r} must be FP32, got {clip(tensor.datatype)}")
    values = _raw_contents(request, tensor.contents.fp32_contents)
    if values is None:
        values = np.asarray(tensor.contents.fp32_contents, dtype=np.float32)
    return client_pixels(tuple(tensor.shape), values, input_shape, PIXELS)


def _raw_contents(request: oip.ModelInferRequest, typed: Sequence) -> bytes | None:
    """The one input's raw_input_contents entry, or None where it comes typed (`typed`, its
    contents field); both, or more raw entries than inputs, get INVALID_ARGUMENT."""
    raw = request.raw_input_contents
    if len(raw) > 1:
        raise InvalidArgument(f"{len(raw)} raw_input_contents entries for one input tensor")
    if raw and len(typed):
        raise InvalidArgument("the input has both raw_input_contents and typed contents")
    return raw[0] if raw else None


def _images(request: oip.ModelInferRequest) -> tuple[bytes, ...]:
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise InvalidArgument(
            f"input {INPUT!r} must be BYTES (encoded images), got {clip(tensor.datatype)}; "
            f"send preprocessed FP32 tensors as input {PIXELS!r}"
        )
    raw = _raw_contents(request, tensor.contents.bytes_contents)
    images = list(tensor.contents.bytes_contents) if raw is None else _bytes_elements(raw)
    shape = list(tensor.shape)
    if any(size < 0 for size in shape):
        raise InvalidArgument(f"input shape {shape[:8]} has a negative size")
    if not shape or shape[1:] not in ([], [1]):
        raise InvalidArgument(f"input {INPUT!r} must have shape [N] or [N, 1], got {shape[:8]}")
    if len(images) != shape[0]:
        raise InvalidArgument(f"input shape {shape} holds {shape[0]} elements, got {len(images)}")
    return tuple(images)


# Requested outputs a request may list: the three outputs, or labels under a few names, with
# room to spare. Each output is a tensor of every image's rows: a request listing one output
# 100 times once built an answer 100 times the size, in every stage, before the send limit
# refused it.
MAX_REQUESTED_OUTPUTS = 8


def _outputs(request: oip.ModelInferRequest, embedding_dim: int) -> tuple[OipOutput, ...]:
    """Requested outputs: every class's probability, k labels, or the embedding. An output
    listed twice alike is answered once (as raystream.v1's `outputs`); listed twice with
    different parameters, or more than MAX_REQUESTED_OUTPUTS outputs: INVALID_ARGUMENT."""
    requested = request.outputs or [oip.ModelInferRequest.InferRequestedOutputTensor(name=SCORES)]
    if len(requested) > MAX_REQUESTED_OUTPUTS:
        raise InvalidArgument(
            f"{len(requested)} outputs requested, over the limit of {MAX_REQUESTED_OUTPUTS}"
        )
    outputs: dict[str, OipOutput] = {}
    for output in requested:
        k = (
            output.parameters["classification"].int64_param
            if ("classification" in output.parameters)
            else 0
        )
        if k < 0:
            raise InvalidArgument(
                f"output {clip(output.name)!r}: classification must be 1 or more, got {k}"
            )
        if k and output.name in (EMBEDDING, EMBEDDING_FP16):
            raise InvalidArgument(
                f"output {output.name!r} has no classes to rank: ask {LABELS!r} or {SCORES!r} "
                "for classification"
            )
        if output.name == SCORES and not k:
            wanted = OipOutput(SCORES, "probabilities")
        elif output.name == LABELS or k:
            wanted = OipOutput(output.name, "labels", k or DEFAULT_TOP_K)
        elif output.name == EMBEDDING:  # checked against the model by the caller
            wanted = OipOutput(EMBEDDING, "embedding")
        elif output.name == EMBEDDING_FP16:
            wanted = OipOutput(EMBEDDING_FP16, "embedding_fp16")
        else:
            embeddings = f", {EMBEDDING}, {EMBEDDING_FP16}" if embedding_dim else ""
            names = f"{SCORES}, {LABELS}{embeddings}"
            raise InvalidArgument(f"unknown output {clip(output.name)!r}; outputs: {names}")
        if outputs.setdefault(wanted.name, wanted) != wanted:
            raise InvalidArgument(
                f"output {clip(wanted.name)!r} requested twice with different parameters"
            )
    return tuple(outputs.values())


class OpenInferenceService(oip_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        core: ServingCore,
        streams: StreamRunner,
        models: ModelLifecycle | None = None,
        model_control: bool = False,
    ) -> None:
        """`models`: the repository extension (index, load, unload); `model_control`: loads
        and unloads allowed (else refused: FAILED_PRECONDITION)."""
        self._core = core
        self._streams = streams
        self._models = models
        self._model_control = model_control

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods, where bytes that are not the method's request are answered
        INVALID_ARGUMENT (gRPC's own parse would end the call, or the whole stream, with
        UNKNOWN). `ModelInfer` refuses them as it refuses a bad request (metrics, logs), and
        the stream reads raw bytes, parsing each message itself (their size comes free)."""
        handlers = {}
        for method in oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
            call, request = getattr(self, method.name), getattr(oip, method.input_type.name)
            if method.name == "ModelStreamInfer":
                serialize = oip.ModelStreamInferResponse.SerializeToString
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(call, None, serialize)
            elif method.name == "ModelInfer":
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    call, parsed_or_none(request), oip.ModelInferResponse.SerializeToString
                )
            else:
                handlers[method.name] = unary_handler(call, request)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _job(self, request: oip.ModelInferRequest, context, flow: str) -> tuple[Job, float | None]:
        core = self._core
        core.check_id(request.id, field="id")
        model = core.check_model(request.model_name, request.model_version, default=False)
        names = [i.name for i in request.inputs]
        if names not in ([INPUT], [PIXELS]):
            raise InvalidArgument(
                f"expected one input tensor, {INPUT!r} (BYTES) or {PIXELS!r} (FP32), "
                f"got {clip(str(names))}"
            )
        outputs = _outputs(request, model.engine.embedding_dim)
        embedding = any(output.kind.startswith("embedding") for output in outputs)
        if embedding:
            core.check_embedding(model)
        top_k = core.top_k(max(output.k for output in outputs) or 1, model)
        if names == [PIXELS]:
            pixels, images = _pixels(request, model.engine.input_shape), ()
        else:
            pixels, images = None, _images(request)
        job = Job(
            id=request.id,
            images=images,
            pixels=pixels,
            top_k=top_k,
            labels=any(output.kind == "labels" for output in outputs),
            scores=any(output.kind == "probabilities" for output in outputs),
            embedding=embedding,
            flow=flow,
            protocol="oip",
            oip_outputs=outputs,
            model=model.key,
        )
        core.check_count(job.count)
        core.check_answer_size(job, model)
        return job, budget_s(0, context)

    async def _infer(self, request: oip.ModelInferRequest | None, context, stream: str) -> Answer:
        """One request through the core: its answer (payload bytes, or code and message);
        None for bytes that were not a request."""
        core = self._core

        def start(reply):
            if request is None:
                job = Job(id="", protocol="oip")
                return core.refuse(job, InvalidArgument(NOT_A_REQUEST), reply, stream)
            try:
                job, budget = self._job(request, context, context.peer())
            except RaystreamError as exc:
                job = Job(id=core.bounded_id(request.id), protocol="oip")
                return core.refuse(job, exc, reply, stream)
            return core.submit(job, reply, stream, budget, tracing.client_parent(context))

        return await core.unary(start)

    async def ModelInfer(self, request, context):
        answer = await self._infer(request, context, "unary")
        if answer.code:
            await context.abort(grpc.StatusCode[code_name(answer.code)], answer.message)
        return oip.ModelInferResponse.FromString(answer.payload)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests run concurrently (as on raystream.v1's stream) and are answered in
        completion order, each with its `id`; a failed one gets `error_message`."""

        parse = parsed_or_none(oip.ModelInferRequest)

        async def answer(raw: bytes) -> oip.ModelStreamInferResponse:
            request = parse(raw)
            del raw  # the parse copied it: one copy held while the request runs, not two
            try:
                result = await self._infer(request, context, "oip-stream")
            except Exception as exc:  # a bug: the request still gets its answer
                return oip.ModelStreamInferResponse(
                    error_message=f"{code_for(exc).name}: {message_for(exc)}"
                )
            if result.code:
                return oip.ModelStreamInferResponse(
                    error_message=f"{code_name(result.code)}: {result.message}",
                    infer_response=oip.ModelInferResponse(
                        id=self._core.bounded_id(request.id if request is not None else "")
                    ),
                )
            return oip.ModelStreamInferResponse(
                infer_response=oip.ModelInferResponse.FromString(result.payload)
            )

        start = TaskStarter(answer)
        try:
            async for response in self._streams.run(request_iterator, start, size=len):
                yield response
        finally:  # the stream ended (or the client left): what still runs is abandoned
            start.cancel()
        if self._streams.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "server is shutting down: requests not answered on this stream were not "
                "processed; send them again",
            )

    # Probes answer without a token when token auth is on (serve_app/ingress/security.py), as the
    # grpc.health.v1 service does.
    async def ServerLive(self, request, context):
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        """False once the server drains (shutdown): balancers stop sending new work."""
        return oip.ServerReadyResponse(ready=not self._streams.draining)

    async def ModelReady(self, request, context):
        try:
            self._core.check_model(request.name, request.version, default=False)
            ready = True
        except RaystreamError:
            ready = False
        return oip.ModelReadyResponse(ready=ready and not self._streams.draining)

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(
            name="raystream",
            version="0.1.0",
            extensions=[
                "classification",
                "model_stream_infer",
                "model_configuration",
                "model_repository",
                "model_repository(unload_dependents)",
            ],
        )

    async def ModelMetadata(self, request, context):
        core = self._core
        try:
            model = core.check_model(request.name, request.version, default=False)
        except RaystreamError as exc:
            await context.abort(grpc.StatusCode[code_name(exc.code)], message_for(exc))
        tensor = oip.ModelMetadataResponse.TensorMetadata
        engine = model.engine
        versions = [request.version] if request.version else core.versions(model.name)
        return oip.ModelMetadataResponse(
            name=model.name,
            versions=[v.version if isinstance(v, Served) else v for v in versions],
            platform=f"raystream_{engine.engine}",
            inputs=[
                # [-1, 1], as Triton reports ModelConfig's dims [1]: a tool that takes the
                # shape of one item from here (perf_analyzer) needs it non-empty
                tensor(name=INPUT, datatype="BYTES", shape=[-1, 1]),
                tensor(name=PIXELS, datatype="FP32", shape=[-1, *engine.input_shape]),
            ],
            outputs=[
                tensor(name=SCORES, datatype="FP32", shape=[-1, engine.num_classes]),
                tensor(name=LABELS, datatype="BYTES", shape=[-1, -1]),
                *(
                    [
                        tensor(name=EMBEDDING, datatype="FP32", shape=[-1, engine.embedding_dim]),
                        tensor(
                            name=EMBEDDING_FP16, datatype="FP16", shape=[-1, engine.embedding_dim]
                        ),
                    ]
                    if engine.embedding_dim
                    else []
                ),
            ],
        )

    # -- Triton's model configuration and model repository extensions -----------------------

    async def ModelConfig(self, request, context):
        """Triton's model configuration, as far as raystream has one: batch size, tensors,
        and the versions served (a specific version policy)."""
        core = self._core
        try:
            model = core.check_model(request.name, request.version, default=False)
        except RaystreamError as exc:
            await context.abort(grpc.StatusCode[code_name(exc.code)], message_for(exc))
        engine = model.engine
        outputs = [
            oip.ModelOutput(name=SCORES, data_type=oip.TYPE_FP32, dims=[engine.num_classes]),
            oip.ModelOutput(name=LABELS, data_type=oip.TYPE_STRING, dims=[-1]),
        ]
        if engine.embedding_dim:
            outputs += [
                oip.ModelOutput(
                    name=EMBEDDING, data_type=oip.TYPE_FP32, dims=[engine.embedding_dim]
                ),
                oip.ModelOutput(
                    name=EMBEDDING_FP16, data_type=oip.TYPE_FP16, dims=[engine.embedding_dim]
                ),
            ]
        versions = [int(m.version) for m in core.versions(model.name) if m.version.isdigit()]
        return oip.ModelConfigResponse(
            config=oip.ModelConfig(
                name=model.name,
                platform=f"raystream_{engine.engine}",
                backend="raystream",
                version_policy=oip.ModelVersionPolicy(
                    specific=oip.ModelVersionPolicy.Specific(versions=versions)
                ),
                max_batch_size=engine.max_batch_size,
                # A request carries one of the two: both optional, as Triton's tools
                # (perf_analyzer) then send only the inputs they are given data for.
                input=[
                    oip.ModelInput(name=INPUT, data_type=oip.TYPE_STRING, dims=[1], optional=True),
                    oip.ModelInput(
                        name=PIXELS,
                        data_type=oip.TYPE_FP32,
                        dims=list(engine.input_shape),
                        optional=True,
                    ),
                ],
                output=outputs,
            )
        )

    async def RepositoryIndex(self, request, context):
        entries = await asyncio.to_thread(self._models.index, request.ready)
        index = oip.RepositoryIndexResponse.ModelIndex
        return oip.RepositoryIndexResponse(
            models=[
                index(name=e.name, version=e.version, state=e.state, reason=e.reason)
                for e in entries
            ]
        )

    async def RepositoryModelLoad(self, request, context):
        """Load `model_name` at the versions of the version policy in the `config`
        parameter (Triton's), else of its entry in the config (else its latest version),
        warmed on every replica before it takes traffic; its other versions are then
        unloaded. Returns once the versions serve."""
        try:
            self._check_model_control()
            # a thread: even a bounded parse must not hold the other clients' event loop
            latest, versions = await asyncio.to_thread(_version_policy, request.parameters)
            name = request.model_name
            if "/" in name:  # raystream: "name/version" loads that version beside the others
                name, version = parse_model_name(name)
                await self._models.load(name, versions=(version,), beside=True)
            else:
                await self._models.load(name, latest, versions)
        except RaystreamError as exc:
            await context.abort(grpc.StatusCode[code_name(exc.code)], message_for(exc))
        return oip.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        """Unload every version of `model_name` (or "name/version": that one) once the
        requests in flight for it are answered; new requests for it get NOT_FOUND."""
        try:
            self._check_model_control()
            await self._models.unload(request.model_name)
        except RaystreamError as exc:
            await context.abort(grpc.StatusCode[code_name(exc.code)], message_for(exc))
        return oip.RepositoryModelUnloadResponse()

    def _check_model_control(self) -> None:
        if not self._model_control:
            raise ModelControlOff(
                "model control is off: this server does not load or unload models at run "
                "time; turn it on with `model_control: {token_file: <a file holding its token>}` "
                "in the application's args (docs/operations.md)"
            )


# The `config` parameter of RepositoryModelLoad: a model configuration is a few hundred bytes.
MAX_CONFIG_CHARS = 64 * 1024
MAX_CONFIG_DEPTH = 16


def _version_policy(parameters) -> tuple[int | None, tuple[str, ...]]:
    """(latest, versions) from the `config` parameter's version_policy, as Triton reads it:
    {"latest": {"num_versions": N}}, {"specific": {"versions": [...]}} or {"all": {}}.
    A config past MAX_CONFIG_CHARS, or nested past MAX_CONFIG_DEPTH, is refused unread."""
    if "config" not in parameters:
        return None, ()
    config = parameters["config"].string_param
    if len(config) > MAX_CONFIG_CHARS:
        raise InvalidArgument(
            f"config parameter is {len(config):,} characters, over the limit of "
            f"{MAX_CONFIG_CHARS:,}"
        )
    too_deep = InvalidArgument(f"config parameter is nested deeper than {MAX_CONFIG_DEPTH} levels")
    try:
        parsed = json.loads(config)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        raise InvalidArgument(f"config parameter is not JSON: {exc}") from None
    if _depth(parsed) > MAX_CONFIG_DEPTH:
        raise too_deep
    try:
        policy = parsed.get("version_policy") or {}
        if "latest" in policy:
            count = policy["latest"].get("num_versions", 1)
            if type(count) is not int or count < 1:
                raise ValueError(
                    f"latest.num_versions must be an integer >= 1, got {clip(repr(count))}"
                )
            return count, ()
        if "specific" in policy:
            listed = policy["specific"]["versions"]
            if not isinstance(listed, list) or not listed:
                raise ValueError(
                    f"specific.versions must be a non-empty list, got {clip(repr(listed))}"
                )
            return None, tuple(str(v) for v in listed)
        if "all" in policy:
            return 1 << 30, ()
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidArgument(f"config parameter: {clip(str(exc), MAX_MESSAGE_CHARS)}") from None
    if policy:
        raise InvalidArgument(f"unknown version_policy {clip(str(policy))}")
    return None, ()


def _depth(value: object) -> int:
    """How deep JSON `value` nests (a scalar: 0), without recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth + 1)
            pending.extend((item, depth + 1) for item in value)
    return deepest
