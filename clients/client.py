"""Async client for raystream's gRPC API.

    async with Client("127.0.0.1:9000") as client:
        async for result in client.classify(paths_or_bytes, batch_size=16):
            print(result.key, result.labels[0].name if result.ok else result.error)
        async for result in client.embed(paths_or_bytes):
            print(result.key, result.vector.shape if result.ok else result.error)

`classify` and `embed` send everything over ONE bidirectional stream, in requests of
`batch_size` images, keeping up to `max_in_flight` requests outstanding; results arrive per
image in completion order, each carrying the key it was sent with.

`Client(address, connections=N)` opens N connections, each on another ingress replica
where several share the port (topology `direct`: a replica serves only the connections the
kernel hands it), and spreads that one logical stream's requests over them. With one
connection or several, a connection whose replica goes away (a redeploy drains it) is
replaced by a new one and the stream carries on, its unanswered requests sent again
(clients/spread.py).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import operator
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from clients.spread import STREAM_ENDED, StreamFn, as_async, error_response, spread
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

REPLICA_METADATA = "raystream-replica"  # serve_app/classifier.py sets it on GetModelInfo
# New connections dialed per ingress replica sought: the kernel hashes each connection to
# one of R replicas sharing the port, so 8R dials all miss a given one with a chance < 0.04%
# (two replicas: 16 dials, 1 in 65,536).
DIALS_PER_REPLICA = 8

__all__ = ["Client", "EmbeddingResult", "EncodedRequest", "ImageResult", "Label", "status_name"]


def status_name(code: int) -> str:
    """google.rpc.Code value -> its name (3 -> INVALID_ARGUMENT)."""
    return next((s.name for s in grpc.StatusCode if s.value[0] == code), str(code))


@dataclass(frozen=True)
class Label:
    class_id: int
    name: str
    score: float


@dataclass(frozen=True)
class ImageResult:
    key: object  # what the caller sent the image as (a path, or its index)
    labels: tuple[Label, ...]
    error_code: int = 0  # google.rpc.Code; 0 when the image was classified
    error: str = ""
    timing: pb.Timing | None = None

    @property
    def ok(self) -> bool:
        return self.error_code == 0


@dataclass(frozen=True)
class EmbeddingResult:
    key: object  # what the caller sent the image as (a path, or its index)
    vector: np.ndarray | None  # float32 (embedding_dim,), norm 1; None when the image failed
    error_code: int = 0  # google.rpc.Code; 0 when the image was embedded
    error: str = ""
    timing: pb.Timing | None = None

    @property
    def ok(self) -> bool:
        return self.error_code == 0


@dataclass(frozen=True)
class EncodedRequest:
    """A ClassifyRequest already serialized, and its id: `stream` and `classify_once` send
    its bytes as they are. For a sender of many alike requests (the load generator), which
    encodes each image once and each request's id anew: encodings joined one after another
    parse as one message holding the fields of all."""

    request_id: str
    data: bytes

    def SerializeToString(self) -> bytes:  # protobuf's name: the stub calls it
        return self.data


Request = pb.ClassifyRequest | EncodedRequest
# The request serializer of _stub's Classify and ClassifyOnce: a message or an EncodedRequest
_SERIALIZE = operator.methodcaller("SerializeToString")


def _stub(channel: grpc.aio.Channel) -> pb_grpc.ImageClassifierStub:
    """The generated stub, with Classify and ClassifyOnce also taking an EncodedRequest."""
    stub = pb_grpc.ImageClassifierStub(channel)
    for name, method in (
        ("Classify", channel.stream_stream),
        ("ClassifyOnce", channel.unary_unary),
    ):
        call = method(
            f"/raystream.v1.ImageClassifier/{name}",
            request_serializer=_SERIALIZE,
            response_deserializer=pb.ClassifyResponse.FromString,
        )
        setattr(stub, name, call)
    return stub


Item = bytes | str | Path | tuple[object, bytes]


def _keyed(items: Iterable[Item]) -> Iterable[tuple[object, bytes]]:
    for index, item in enumerate(items):
        if isinstance(item, tuple):
            yield item
        elif isinstance(item, str | Path):
            yield item, Path(item).read_bytes()
        else:
            yield index, item


def vector_of(embedding: pb.Embedding) -> np.ndarray:
    """An `Embedding`'s vector: float16 where the server sent halves, else float32."""
    if embedding.values_fp16:
        return np.frombuffer(embedding.values_fp16, "<f2").astype(np.float16)
    return np.array(embedding.values, np.float32)


class Client:
    def __init__(
        self,
        address: str = "127.0.0.1:9000",
        *,
        connections: int = 1,
        timeout: float | None = None,
        connect_timeout: float = 30.0,
        resends: int = 2,
        reconnect: bool = True,
        max_message_bytes: int = 64 * 1024 * 1024,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
    ) -> None:
        """`connections`: above 1, open up to that many connections, each on another ingress
        replica (each dial's GetModelInfo bounded by `connect_timeout`; a server that is
        down fails with UNAVAILABLE within a few seconds), and spread `stream`, `classify`
        and `classify_once` over them. `reconnect`: a stream whose connection fails with
        UNAVAILABLE (its replica draining in a redeploy, or gone) carries on over a new
        connection, which waits up to `connect_timeout` for a server to answer if the old
        one had answered a request OK (else it gives up in about 2 s); a request answered
        UNAVAILABLE, or left unanswered by the failed stream, is sent again, on another connection
        where there is one, up to `resends` times. Without it, such a stream ends with that
        status, each request it left unanswered answered with it. `token`: sent as
        `authorization: Bearer <token>`. `tls_ca`: connect with TLS, trusting this CA (PEM
        file); `tls_cert`/`tls_key`: a client certificate (mTLS)."""
        if connections < 1:
            raise ValueError(f"connections must be at least 1, got {connections}")
        self.address = address
        self._wanted = connections
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._resends = resends
        self._reconnect = reconnect
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._credentials = None
        if tls_ca or tls_cert:
            read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=read(tls_ca),
                private_key=read(tls_key),
                certificate_chain=read(tls_cert),
            )
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # a connection of its own per channel, even to the same address
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.ImageClassifierStub] = []
        self._replicas: dict[int, str] = {}  # connection -> its ingress replica, once known
        self._ids = itertools.count()
        self._unary: collections.Counter[int] = collections.Counter()  # calls in flight
        self._turn = 0

    async def __aenter__(self) -> Client:
        if self._wanted == 1:
            self._channels.append(self._channel())
            self._stubs.append(_stub(self._channels[-1]))
        else:
            try:
                await self._open_spread()
            except BaseException:
                await self.close()
                raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        channels, self._channels, self._stubs, self._replicas = self._channels, [], [], {}
        for channel in channels:
            await channel.close()

    def _channel(self) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.address, options=self._options)
        return grpc.aio.secure_channel(self.address, self._credentials, options=self._options)

    async def _dial(
        self, avoid: set[str], dials: int, wait: bool = False
    ) -> tuple[grpc.aio.Channel, str]:
        """A new connection on a replica not in `avoid` if `dials` dials find one (else on
        the last one dialed), with the replica it landed on ("" if the server does not say,
        which is never avoided). A dial answered UNAVAILABLE (a replica draining, or nothing
        listening) is followed by the next, a little later; the last one's error is raised.
        With `wait`, each dial waits up to `connect_timeout` for a server to listen (one
        restarting)."""
        for dial in range(1, dials + 1):
            channel = self._channel()
            stub = _stub(channel)
            try:
                replica = await self._replica_of(stub, self._connect_timeout, wait)
            except grpc.aio.AioRpcError as exc:
                await channel.close()
                if exc.code() != grpc.StatusCode.UNAVAILABLE or dial == dials:
                    raise
                await asyncio.sleep(0.05 * dial)
                continue
            except BaseException:
                await channel.close()
                raise
            if not replica or replica not in avoid or dial == dials:
                return channel, replica
            await channel.close()
        raise ValueError("dials must be at least 1")

    async def _open_spread(self) -> None:
        """Up to `connections` connections on distinct ingress replicas. Dialing stops once
        8 dials per replica sought (those found and the next), in a row, found no new one
        (fewer replicas than asked)."""
        while len(self._channels) < self._wanted:
            seen = set(self._replicas.values())
            # 8 per replica sought: with 8 per replica found, the second connection of two had
            # 8 dials, all on the first replica 1 time in 256
            channel, replica = await self._dial(seen, DIALS_PER_REPLICA * (len(seen) + 1))
            if replica and replica in seen:
                await channel.close()
                return
            self._replicas[len(self._channels)] = replica
            self._channels.append(channel)
            self._stubs.append(_stub(channel))

    async def _reopen(self, index: int, wait: bool) -> StreamFn:
        """A stream on a new connection in place of connection `index`, whose stream failed
        (clients/spread.py): on a replica that no other connection is on, if 8 dials find
        one (the replica that failed, if it is only restarting, counts as free). With
        `wait` (the old one had answered), each dial waits up to `connect_timeout` for a
        server to listen; without, a server that is not running fails it in about 2 s."""
        others = {replica for i, replica in self._replicas.items() if i != index}
        channel, replica = await self._dial(others, DIALS_PER_REPLICA, wait=wait)
        old = self._channels[index]
        self._channels[index] = channel
        self._stubs[index] = _stub(channel)
        self._replicas[index] = replica
        await old.close()
        return functools.partial(self._stream_on, self._stubs[index])

    @property
    def stub(self) -> pb_grpc.ImageClassifierStub:
        """The first connection's stub (it changes when that connection is replaced)."""
        return self._stubs[0]

    @property
    def connections(self) -> int:
        """Connections open (fewer than asked when the server has fewer ingress replicas)."""
        return len(self._stubs)

    async def wait_ready(self, timeout: float = 60.0) -> pb.ModelInfo:
        """Poll GetModelInfo until the server answers (readiness), or raise TimeoutError."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return await self.model_info(timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                if (
                    exc.code() != grpc.StatusCode.UNAVAILABLE
                    or asyncio.get_running_loop().time() > deadline
                ):
                    raise
            await asyncio.sleep(0.2)

    async def model_info(self, model: str = "", *, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(
            pb.ModelInfoRequest(model=model),
            timeout=timeout or self._timeout,
            metadata=self._metadata,
        )

    # -- the model repository (the Open Inference Protocol's repository extension) ----------

    def _repository(self):
        from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc

        return oip_grpc.GRPCInferenceServiceStub(self._channels[0])

    async def models(self, *, ready: bool = False) -> list[tuple[str, str, str, str]]:
        """Every version in the server's repository: (name, version, state, reason)."""
        from raystream.oip import grpc_predict_v2_pb2 as oip

        index = await self._repository().RepositoryIndex(
            oip.RepositoryIndexRequest(ready=ready), metadata=self._metadata
        )
        return [(m.name, m.version, m.state, m.reason) for m in index.models]

    async def load_model(
        self,
        name: str,
        *,
        latest: int | None = None,
        versions: Iterable[str] = (),
        timeout: float | None = None,
    ) -> None:
        """Serve `name` at the versions of a policy (none: the server's), warmed before
        they take traffic; its other versions are unloaded. Returns once they serve; past
        `timeout` seconds it raises DEADLINE_EXCEEDED and the server goes on with it."""
        import json

        from raystream.oip import grpc_predict_v2_pb2 as oip

        policy = (
            {"latest": {"num_versions": latest}}
            if latest
            else {"specific": {"versions": [int(v) for v in versions]}}
            if versions
            else None
        )
        parameters = (
            {
                "config": oip.ModelRepositoryParameter(
                    string_param=json.dumps({"version_policy": policy})
                )
            }
            if policy
            else {}
        )
        await self._repository().RepositoryModelLoad(
            oip.RepositoryModelLoadRequest(model_name=name, parameters=parameters),
            metadata=self._metadata,
            timeout=timeout,
        )

    async def unload_model(self, name: str, *, timeout: float | None = None) -> None:
        """Stop serving `name` ("name": every version; "name/version": that one) once the
        requests in flight for it are answered (past `timeout` seconds: DEADLINE_EXCEEDED,
        and the server goes on with it)."""
        from raystream.oip import grpc_predict_v2_pb2 as oip

        await self._repository().RepositoryModelUnload(
            oip.RepositoryModelUnloadRequest(model_name=name),
            metadata=self._metadata,
            timeout=timeout,
        )

    async def replica(self) -> str:
        """The ingress replica this (first) connection landed on ("" from a server that
        does not say). Replicas share one port and the kernel hashes each connection to
        one of them."""
        if 0 in self._replicas:
            return self._replicas[0]
        return await self._replica_of(self.stub, self._timeout)

    async def replicas(self) -> list[str]:
        """The ingress replica of each connection, in order."""
        for index, stub in enumerate(self._stubs):
            if index not in self._replicas:
                self._replicas[index] = await self._replica_of(stub, self._timeout)
        return [self._replicas[index] for index in range(len(self._stubs))]

    async def _replica_of(
        self, stub: pb_grpc.ImageClassifierStub, timeout: float | None, wait: bool = False
    ) -> str:
        call = stub.GetModelInfo(
            pb.ModelInfoRequest(), timeout=timeout, metadata=self._metadata, wait_for_ready=wait
        )
        await call
        trailing = await call.trailing_metadata()
        return next((value for key, value in trailing or () if key == REPLICA_METADATA), "")

    async def classify_once(
        self,
        images: list[bytes] | pb.ClassifyRequest | EncodedRequest,
        *,
        top_k: int = 5,
        model: str = "",
        metadata: Sequence[tuple[str, str]] = (),
    ) -> pb.ClassifyResponse:
        """Unary call on `images` (or on a ready-made request), on the connection with the
        fewest unary calls in flight (ties take turns). `metadata`: sent with the call, such
        as a W3C `traceparent` (the server's spans then join the caller's trace)."""
        request = (
            images
            if isinstance(images, pb.ClassifyRequest | EncodedRequest)
            else pb.ClassifyRequest(
                request_id=str(next(self._ids)), images=images, top_k=top_k, model=model
            )
        )
        count = len(self._stubs)
        index = min(range(count), key=lambda i: (self._unary[i], (i - self._turn) % count))
        self._turn = index + 1
        self._unary[index] += 1
        try:
            sent = (*(self._metadata or ()), *metadata) or None
            return await self._stubs[index].ClassifyOnce(
                request, timeout=self._timeout, metadata=sent
            )
        finally:
            self._unary[index] -= 1

    async def stream(
        self, requests: AsyncIterable[Request] | Iterable[Request]
    ) -> AsyncIterator[pb.ClassifyResponse]:
        """The raw bidi stream: send requests (messages or EncodedRequests), receive
        responses (in completion order).

        Every request sent gets exactly one response. If the stream itself fails (the server
        shuts down, a message is over the size limit, the connection drops), each request
        still unanswered gets a response carrying the stream's status code and message,
        and then the stream's error (grpc.aio.AioRpcError) is raised; with `reconnect`, a
        stream that failed UNAVAILABLE first carries on over a new connection. Over several
        connections, see clients/spread.py."""
        if len(self._stubs) == 1 and not self._reconnect:
            # the call itself, without spread()'s queues: what the load generator measures with
            responses = self._stream_on(self.stub, requests)
        else:
            streams = [functools.partial(self._stream_on, stub) for stub in self._stubs]
            reopen = self._reopen if self._reconnect else None
            responses = spread(streams, requests, reopen, self._resends)
        async for response in responses:
            yield response

    async def _stream_on(
        self,
        stub: pb_grpc.ImageClassifierStub,
        requests: AsyncIterable[Request] | Iterable[Request],
    ) -> AsyncIterator[pb.ClassifyResponse]:
        unanswered: collections.Counter[str] = collections.Counter()
        call = stub.Classify(timeout=self._timeout, metadata=self._metadata)

        async def send_all() -> None:
            try:
                async for request in as_async(requests):
                    unanswered[request.request_id] += 1  # counted before it can fail to go out
                    await call.write(request)
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the call ended; reading the responses says why

        # Our own sender task, so that once the stream fails we know exactly what was sent.
        sender = asyncio.create_task(send_all())
        try:
            async for response in call:
                unanswered[response.request_id] -= 1
                yield response
            await sender
        except grpc.aio.AioRpcError as exc:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            message = f"{STREAM_ENDED}: {exc.details()}"
            for request_id, count in unanswered.items():
                for _ in range(count):
                    yield error_response(request_id, exc.code(), message)
            raise
        finally:
            sender.cancel()
            call.cancel()

    async def classify(
        self,
        items: Iterable[Item],
        *,
        batch_size: int = 16,
        top_k: int = 5,
        model: str = "",
        max_in_flight: int = 8,
    ) -> AsyncIterator[ImageResult]:
        """Classify every item over one stream; yields one ImageResult per image.

        Items are bytes, paths, or (key, bytes) pairs. A request-level error (bad top_k,
        unknown model) is reported on each of that request's images.
        """
        fields = {"top_k": top_k, "model": model}
        async for key, result, response in self._per_image(
            items, batch_size, max_in_flight, fields
        ):
            if result is None:
                yield ImageResult(
                    key, (), response.error.code, response.error.message, response.timing
                )
                continue
            labels = tuple(Label(lb.class_id, lb.name, lb.score) for lb in result.labels)
            yield ImageResult(key, labels, result.error.code, result.error.message, response.timing)

    async def embed(
        self,
        items: Iterable[Item],
        *,
        batch_size: int = 16,
        model: str = "",
        max_in_flight: int = 8,
        fp16: bool = False,
    ) -> AsyncIterator[EmbeddingResult]:
        """Embed every item over one stream; yields one EmbeddingResult per image: its key
        and its vector (norm 1, `model_info().embedding_dim` long: float32, or float16 with
        `fp16`, which also halves the bytes on the wire), or its error.

        Items are bytes, paths, or (key, bytes) pairs. A request-level error (a model without
        embeddings, an unknown model) is reported on each of that request's images. Vectors
        compare only within one `model_info().embedding_space`.
        """
        dtype = pb.FLOAT16 if fp16 else pb.FLOAT32
        fields = {"model": model, "outputs": [pb.EMBEDDING], "embedding_dtype": dtype}
        async for key, result, response in self._per_image(
            items, batch_size, max_in_flight, fields
        ):
            if result is None:
                yield EmbeddingResult(
                    key, None, response.error.code, response.error.message, response.timing
                )
            elif result.error.code:
                yield EmbeddingResult(
                    key, None, result.error.code, result.error.message, response.timing
                )
            else:
                yield EmbeddingResult(key, vector_of(result.embedding), timing=response.timing)

    async def _per_image(
        self, items: Iterable[Item], batch_size: int, max_in_flight: int, fields: dict
    ) -> AsyncIterator[tuple[object, pb.ImageResult | None, pb.ClassifyResponse]]:
        """Every item over one stream, in requests of `batch_size` images with `fields`:
        (key, its result or None if its request failed as a whole, the response)."""
        pending: dict[str, list[object]] = {}
        slots = asyncio.Semaphore(max_in_flight)

        async def requests() -> AsyncIterator[pb.ClassifyRequest]:
            keyed = iter(_keyed(items))
            while chunk := list(itertools.islice(keyed, batch_size)):
                await slots.acquire()
                request_id = str(next(self._ids))
                pending[request_id] = [key for key, _ in chunk]
                yield pb.ClassifyRequest(
                    request_id=request_id, images=[d for _, d in chunk], **fields
                )

        async for response in self.stream(requests()):
            slots.release()
            keys = pending.pop(response.request_id)
            if response.error.code:
                for key in keys:
                    yield key, None, response
                continue
            for key, result in zip(keys, response.results, strict=True):
                yield key, result, response
