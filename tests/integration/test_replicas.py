"""Spreading load-generator connections over ingress replicas that share one port: two real
grpc.aio servers bound with SO_REUSEPORT, each saying which one it is as the ingress does."""

from __future__ import annotations

import socket

import grpc
import pytest

from clients.client import REPLICA_METADATA
from clients.loadgen import DIALS_PER_REPLICA, _connect, find_replicas
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc


class _Named(pb_grpc.ImageClassifierServicer):
    def __init__(self, name: str) -> None:
        self.name = name

    async def GetModelInfo(self, request, context):
        context.set_trailing_metadata(((REPLICA_METADATA, self.name),))
        return pb.ModelInfo(name="m")


@pytest.fixture
async def two_replicas():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    servers = []
    for name in ("replica-a", "replica-b"):
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        pb_grpc.add_ImageClassifierServicer_to_server(_Named(name), server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        servers.append(server)
    yield f"127.0.0.1:{port}"
    for server in servers:
        await server.stop(None)


async def test_connections_reach_every_replica(two_replicas) -> None:
    assert await find_replicas(two_replicas, 2, {}) == ["replica-a", "replica-b"]
    assert await find_replicas(two_replicas, 1, {}) == []  # one connection: nothing to spread
    for replica in ("replica-a", "replica-b", "replica-a"):
        client = await _connect(two_replicas, replica, DIALS_PER_REPLICA * 2, {})
        try:
            assert await client.replica() == replica
        finally:
            await client.close()
