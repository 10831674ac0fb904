"""One logical stream over several connections (clients/spread.py, Client(connections=N)).

Transport tests: two real grpc.aio servers share one port as direct ingress replicas do
(SO_REUSEPORT), each answering with its own name; then the real app, topology direct, two
replicas with the echo engine. Dispatch and failover also run on in-memory streams, where
the order of events can be fixed with asyncio events instead of timing."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from clients.client import REPLICA_METADATA, Client
from clients.spread import error_response, spread
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

from conftest import free_port


class NamedReplica(pb_grpc.ImageClassifierServicer):
    """Answers every request with one label: its own name. With `fail_after`, aborts its
    stream with UNAVAILABLE on receiving that many requests, answering none of the last."""

    def __init__(self, name: str, fail_after: int | None = None) -> None:
        self.name, self.fail_after, self.received = name, fail_after, 0

    async def GetModelInfo(self, request, context):
        context.set_trailing_metadata(((REPLICA_METADATA, self.name),))
        return pb.ModelInfo(name="named")

    async def Classify(self, request_iterator, context):
        async for request in request_iterator:
            self.received += 1
            if self.fail_after is not None and self.received >= self.fail_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is going away")
            response = pb.ClassifyResponse(request_id=request.request_id)
            response.results.add().labels.add(name=self.name)
            yield response


async def _serve(replicas: list[NamedReplica]) -> tuple[str, list[grpc.aio.Server]]:
    """Every replica on one port, the way Serve's ingress replicas share theirs."""
    servers, port = [], 0
    for replica in replicas:
        server = grpc.aio.server()
        pb_grpc.add_ImageClassifierServicer_to_server(replica, server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
    return f"127.0.0.1:{port}", servers


def _requests(count: int) -> list[pb.ClassifyRequest]:
    return [pb.ClassifyRequest(request_id=str(i), images=[b"x"]) for i in range(count)]


async def test_one_stream_reaches_every_replica_sharing_the_port() -> None:
    address, servers = await _serve([NamedReplica("a"), NamedReplica("b")])
    try:
        async with Client(address, connections=4) as client:
            # four asked, two replicas behind the port: one connection on each
            assert client.connections == 2
            assert sorted(await client.replicas()) == ["a", "b"]
            answered = [r async for r in client.stream(_requests(40))]
        assert sorted(int(r.request_id) for r in answered) == list(range(40))  # once each
        by = collections.Counter(r.results[0].labels[0].name for r in answered)
        assert by["a"] > 0 and by["b"] > 0, by
        async with Client(address) as single:  # the default: one connection, one replica
            assert single.connections == 1
            names = {r.results[0].labels[0].name async for r in single.stream(_requests(10))}
            assert len(names) == 1
    finally:
        await asyncio.gather(*(server.stop(None) for server in servers))


async def test_a_server_that_is_down_fails_the_connect_at_once() -> None:
    start = asyncio.get_running_loop().time()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async with Client(f"127.0.0.1:{free_port()}", connections=2, connect_timeout=20):
            pass
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert asyncio.get_running_loop().time() - start < 10  # not the connect timeout


async def test_a_failing_replica_answers_its_own_requests_and_the_rest_go_on() -> None:
    """Replica a aborts its stream on its third request: the requests it had are answered
    with UNAVAILABLE, every other request is answered by b, and the stream's error is
    raised at the end, as one stream raises its own."""
    address, servers = await _serve([NamedReplica("a", fail_after=3), NamedReplica("b")])
    answered: list[pb.ClassifyResponse] = []
    try:
        async with Client(address, connections=2) as client:
            assert client.connections == 2
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for response in client.stream(_requests(30)):
                    answered.append(response)
    finally:
        await asyncio.gather(*(server.stop(None) for server in servers))
    # grpcio's aio client may report INTERNAL "Internal error from Core" instead of the
    # server's status when a write races the server's abort (grpc/grpc#36066, still open).
    codes = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}
    assert raised.value.code() in codes
    assert sorted(int(r.request_id) for r in answered) == list(range(30))  # once each
    failed = [r for r in answered if r.error.code]
    assert failed and all(r.error.code == raised.value.code().value[0] for r in failed)
    if raised.value.code() == grpc.StatusCode.UNAVAILABLE:
        assert all("a is going away" in r.error.message for r in failed)
    by = collections.Counter(r.results[0].labels[0].name for r in answered if not r.error.code)
    assert by["a"] == 2 and by["b"] == 30 - 2 - len(failed), by


def _answering(log: list[str], gate: asyncio.Event | None = None):
    """An in-memory stream: answers each request (after `gate`, if given), logging its id."""

    async def stream(requests):
        async for request in requests:
            log.append(request.request_id)
            if gate is not None:
                await gate.wait()
            yield pb.ClassifyResponse(request_id=request.request_id)

    return stream


async def test_requests_go_to_the_stream_with_fewest_unanswered() -> None:
    """Stream 0 holds its first request unanswered; while it does, every later request goes
    to stream 1 (turn-taking alone would send half to stream 0)."""
    held, fast, gate = [], [], asyncio.Event()
    answered = 0

    async def requests():
        for i in range(20):
            while answered < i - 1:  # one answered before the next goes out
                await asyncio.sleep(0)
            yield pb.ClassifyRequest(request_id=str(i))
            if i == 19:
                gate.set()

    ids = []
    async for response in spread([_answering(held, gate), _answering(fast)], requests()):
        answered += 1
        ids.append(response.request_id)
    assert sorted(ids, key=int) == [str(i) for i in range(20)]
    assert held == ["0"] and len(fast) == 19


async def test_requests_not_yet_sent_move_to_another_stream_or_fail_when_none_is_left() -> None:
    def failing(after: int):
        async def stream(requests):
            count = 0
            async for request in requests:
                count += 1
                if count > after:  # answers what it took, as Client's streams do, then fails
                    code = grpc.StatusCode.UNAVAILABLE
                    yield error_response(request.request_id, code, "gone")
                    raise grpc.aio.AioRpcError(
                        code, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
                    )
                yield pb.ClassifyResponse(request_id=request.request_id)

        return stream

    answered = []
    with pytest.raises(grpc.aio.AioRpcError):
        async for response in spread([failing(2), failing(3)], _requests(12)):
            answered.append(response)
    # Once both streams failed, no more requests are taken (as one failed stream takes no
    # more); each taken one is answered once: 2 + 3 before the failures, the two that failed
    # them, and any queued then, never sent, with "no connection left".
    assert sorted(int(r.request_id) for r in answered) == list(range(len(answered)))
    assert sum(not r.error.code for r in answered) == 5
    assert sum(r.error.message == "gone" for r in answered) == 2
    failed = [r for r in answered if r.error.code]
    assert all(r.error.code == grpc.StatusCode.UNAVAILABLE.value[0] for r in failed)
    unsent = [r.error.message for r in failed if r.error.message != "gone"]
    assert all(m == "no connection left to send this request on: gone" for m in unsent)


@pytest.mark.slow
async def test_direct_replicas_share_one_long_stream(ray_cluster, model_repository, photos) -> None:
    """The real app, topology direct, two ingress replicas on one port: a client with
    connections=2 reaches both over one logical stream. (Echo engine: this is transport.)"""
    from ray import serve

    from serve_app.app import DIRECT_REPLICA_ENV
    from serve_app.config import AppConfig
    from serve_app.ingress import Ingress

    port = free_port()  # replicas share a port only when it is given (0: one each)
    config = AppConfig.model_validate(
        {"model_repository": str(model_repository), "port": port, "topology": "direct"}
        | {"engine": {"kind": "echo"}}
    ).model_dump(mode="json")
    options = {"num_cpus": 0.25, "runtime_env": {"env_vars": DIRECT_REPLICA_ENV}}
    serve.start(proxy_location="Disabled")
    app = Ingress.options(num_replicas=2, ray_actor_options=options).bind(config)
    handle = serve.run(app, name="spread", route_prefix=None)
    try:
        assert await handle.port.remote() == port
        async with Client(f"127.0.0.1:{port}", connections=2) as client:
            assert client.connections == 2
            assert len(set(await client.replicas())) == 2
            images = [b"not an image", photos["chelsea"], photos["coffee"]] * 8
            results = [r async for r in client.classify(images, batch_size=2)]
        assert len(results) == 8 * 3
        assert sum(r.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for r in results) == 8
        assert all(r.ok for r in results if r.key % 3)
    finally:
        serve.delete("spread")
