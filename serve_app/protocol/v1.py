"""raystream.v1.ImageClassifier over the serving core (serve_app/core/serving.py): requests parsed
and checked here, answers written as the bytes the postprocess stage made (the response
serializer is the identity: this replica never re-encodes a response).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from raystream.v1 import classifier_pb2 as pb
from serve_app.core.messages import Answer, Job
from serve_app.core.serving import ServingCore
from serve_app.errors import (
    DuplicateRequest,
    InvalidArgument,
    RaystreamError,
    clip,
    parsed_or_none,
)
from serve_app.observability import tracing
from serve_app.protocol.streams import StreamRunner
from serve_app.tuning import SPLIT_MIN_BYTES
from serve_app.wire.pixels import client_pixels
from serve_app.wire.request_images import split_images

SERVICE = pb.DESCRIPTOR.services_by_name["ImageClassifier"].full_name
IMAGES_FIELD = pb.ClassifyRequest.DESCRIPTOR.fields_by_name["images"].number
REPLICA_METADATA = "raystream-replica"


def budget_s(timeout_ms: int, context: grpc.aio.ServicerContext | None) -> float | None:
    """Seconds a request may take: its own timeout or what is left of the call's gRPC
    deadline (a stream's deadline bounds every request on it), whichever is sooner."""
    budgets = [timeout_ms / 1000.0] if timeout_ms else []
    remaining = context.time_remaining() if context is not None else None
    if remaining is not None:
        budgets.append(max(remaining, 0.0))
    return min(budgets) if budgets else None


def unary_handler(call, message: type) -> grpc.RpcMethodHandler:
    """A unary method's handler whose bytes that are not a `message` are refused with
    INVALID_ARGUMENT (gRPC's own parse answers UNKNOWN); its response goes out as protobuf."""
    name = message.DESCRIPTOR.full_name

    async def checked(request, context):
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"message is not a {name}")
        return await call(request, context)

    return grpc.unary_unary_rpc_method_handler(checked, parsed_or_none(message), _serialized)


def _serialized(response) -> bytes:
    return response.SerializeToString()


def outputs(requested: Sequence[int]) -> tuple[bool, bool]:
    """(labels, embedding): what a request's `outputs` ask for; empty means labels."""
    labels = embedding = False
    for value in requested or (pb.LABELS,):
        if value in (pb.OUTPUT_UNSPECIFIED, pb.LABELS):
            labels = True
        elif value == pb.EMBEDDING:
            embedding = True
        else:
            raise InvalidArgument(
                f"unknown output {value}; outputs: LABELS ({pb.LABELS}), EMBEDDING ({pb.EMBEDDING})"
            )
    return labels, embedding


@dataclass(frozen=True)
class _Read:
    """A message read from a stream: its size on the wire (what it holds in memory), and the
    request without its images and the images, or None if the bytes are not a
    ClassifyRequest."""

    raw: bytes
    request: pb.ClassifyRequest | None
    images: Sequence[bytes] = ()

    @property
    def size(self) -> int:
        return len(self.raw)


async def _parsed(messages: AsyncIterator[bytes]) -> AsyncIterator[_Read]:
    """Parsed here rather than by gRPC: the size comes free (ByteSize re-encodes the whole
    message), a malformed message fails alone instead of ending the stream, and a large
    message's images stay in it as received (serve_app/wire/request_images.py)."""
    async for raw in messages:
        split = split_images(raw, IMAGES_FIELD) if len(raw) >= SPLIT_MIN_BYTES else None
        try:
            if split is None:
                request = pb.ClassifyRequest.FromString(raw)
                images = tuple(request.images)
            else:
                rest, images = split
                request = pb.ClassifyRequest.FromString(rest)
        except DecodeError:
            yield _Read(raw, None)
            continue
        yield _Read(raw, request, images)


class ClassifierService:
    def __init__(
        self, core: ServingCore, streams: StreamRunner, route: tuple[str, ...] = ()
    ) -> None:
        self._core = core
        self._streams = streams
        self._route = route  # serve_app/pipeline/route.py, as ModelInfo.route

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods; Classify and ClassifyOnce answer with bytes as they are."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                # Raw bytes in: the stream parses them itself (serve_app/protocol/v1.py _parsed)
                "Classify": grpc.stream_stream_rpc_method_handler(self.Classify, None, None),
                "ClassifyOnce": grpc.unary_unary_rpc_method_handler(
                    self.ClassifyOnce, parsed_or_none(pb.ClassifyRequest), None
                ),
                "GetModelInfo": unary_handler(self.GetModelInfo, pb.ModelInfoRequest),
            },
        )

    def _start(
        self,
        request: pb.ClassifyRequest | None,
        images: Sequence[bytes],
        reply: Callable[[Answer], None],
        context: grpc.aio.ServicerContext,
        flow: str,
        stream: str,
    ):
        """Check `request` (its `images` apart; None: bytes that were not a request) and
        hand it to the core; refusals are answered at once."""
        core = self._core
        if request is None:
            exc = InvalidArgument("message is not a raystream.v1.ClassifyRequest")
            return core.refuse(Job(id=""), exc, reply, stream)
        request_id, job = core.bounded_id(request.request_id), None
        try:
            core.check_id(request.request_id)
            model = core.check_model(request.model)
            top_k = core.top_k(request.top_k, model)
            labels, embedding = outputs(request.outputs)
            if embedding:
                core.check_embedding(model)
            if request.embedding_dtype not in (pb.FLOAT32, pb.FLOAT16):
                raise InvalidArgument(
                    f"unknown embedding_dtype {request.embedding_dtype}; "
                    f"FLOAT32 ({pb.FLOAT32}) or FLOAT16 ({pb.FLOAT16})"
                )
            pixels = None
            if request.HasField("pixels"):
                if images:
                    raise InvalidArgument("send images or pixels in a request, not both")
                tensor = request.pixels
                pixels = client_pixels(
                    tuple(tensor.shape), tensor.data, model.engine.input_shape, "pixels"
                )
            job = Job(
                id=request_id,
                images=images,
                pixels=pixels,
                top_k=top_k,
                labels=labels,
                embedding=embedding,
                embedding_fp16=request.embedding_dtype == pb.FLOAT16,
                flow=flow,
                model=model.key,
            )
            core.check_count(job.count)
            core.check_answer_size(job, model)
        except RaystreamError as exc:
            refused = job if job is not None else Job(id=request_id)
            return core.refuse(refused, exc, reply, stream)
        budget = budget_s(request.timeout_ms, context)
        return core.submit(job, reply, stream, budget, tracing.client_parent(context))

    async def Classify(self, request_iterator, context):
        """Bidi stream: requests run concurrently, answered in completion order."""
        stream = uuid.uuid4().hex[:12]
        pending = []

        def start(read: _Read, reply: Callable[[Answer], None]) -> None:
            handle = self._start(
                read.request, read.images, lambda a: reply(a.payload), context, stream, stream
            )
            if handle is not None:
                pending.append(handle)
                if len(pending) > 256:  # forget the answered ones now and then
                    pending[:] = [p for p in pending if not p.done]

        def duplicate(read: _Read) -> bytes:
            request = read.request
            exc = DuplicateRequest(
                f"request_id {clip(request.request_id)!r} is already in flight on this stream"
            )
            answered: list[Answer] = []
            self._core.refuse(Job(id=request.request_id), exc, answered.append, stream)
            return answered[0].payload

        try:
            async for payload in self._streams.run(
                _parsed(request_iterator),
                start,
                key=self._duplicate_key,
                duplicate=duplicate,
                size=_Read.size.fget,
            ):
                yield payload
        finally:
            for handle in pending:  # the client went away: drop what it still waits for
                self._core.abandon(handle)
        if self._streams.draining:
            # What the client sent after reading stopped was never read: safe to resend.
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "server is shutting down: requests not answered on this stream were not "
                "processed; send them again",
            )

    def _duplicate_key(self, read: _Read) -> str:
        """Ids over the limit are refused by their checks, never matched as duplicates."""
        if read.request is None:
            return ""
        request_id = read.request.request_id
        too_long = len(request_id) > len(self._core.bounded_id(request_id))
        return "" if too_long else request_id

    async def ClassifyOnce(self, request, context):
        images, peer = tuple(request.images) if request is not None else (), context.peer()
        answer = await self._core.unary(
            lambda reply: self._start(request, images, reply, context, peer, "unary")
        )
        return answer.payload

    async def GetModelInfo(self, request, context):
        core = self._core
        try:
            model = core.check_model(request.model)
        except RaystreamError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        context.set_trailing_metadata(((REPLICA_METADATA, core.replica),))
        engine = model.engine
        return pb.ModelInfo(
            name=model.name,
            version=model.version,
            engine=engine.engine,
            input_shape=[-1, *engine.input_shape],
            num_classes=engine.num_classes,
            max_batch_size=engine.max_batch_size,
            precision=engine.precision,
            embedding_dim=engine.embedding_dim,
            embedding_space=model.embedding_space,
            route=self._route,
        )
