"""TLS (with client certificates) and token auth on a real ingress: certificates made here,
the app under real Ray Serve. The engine is `echo`: this test is about transport."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from clients.client import Client

from conftest import start_app

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secure_server(ray_cluster, model_repository, pki):
    from ray import serve

    security = {
        "tls_cert": str(pki["server_cert"]),
        "tls_key": str(pki["server_key"]),
        "tls_client_ca": str(pki["ca"]),
        "auth_token_file": str(_token_file(pki)),
    }
    port, handle = start_app(
        "secure", model_repository, topology="fused", engine={"kind": "echo"}, security=security
    )
    yield f"localhost:{port}", handle
    serve.delete("secure")


def _token_file(pki) -> Path:
    token = pki["ca"].parent / "token"
    token.write_text(TOKEN + "\n")
    return token


def _tls(pki) -> dict:
    return {"tls_ca": pki["ca"], "tls_cert": pki["client_cert"], "tls_key": pki["client_key"]}


async def test_tls_and_token_let_a_client_in(secure_server, pki, photos) -> None:
    address, _ = secure_server
    async with Client(address, token=TOKEN, **_tls(pki)) as client:
        results = [r async for r in client.classify([photos["coffee"]])]
        assert results[0].ok and results[0].labels  # echo engine: transport only
        assert (await client.model_info()).engine == "echo"


async def test_wrong_or_missing_token_is_unauthenticated_and_does_no_work(
    secure_server, pki, photos
) -> None:
    address, handle = secure_server
    before = await handle.requests_started.remote()
    for token in (None, "wrong"):
        async with Client(address, token=token, **_tls(pki)) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in client.classify([photos["coffee"]])]
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.classify_once([photos["coffee"]])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await handle.requests_started.remote() == before


async def test_plaintext_and_certificate_less_clients_are_refused(secure_server, pki) -> None:
    address, _ = secure_server
    async with Client(address, token=TOKEN) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plaintext.model_info(timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    async with Client(address, token=TOKEN, tls_ca=pki["ca"]) as no_client_cert:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await no_client_cert.model_info(timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_probes_answer_without_a_token_and_nothing_else_does(secure_server, pki) -> None:
    """One rule for probes: grpc.health.v1 and OIP ServerLive/ServerReady need no token
    (a Kubernetes probe has none); every other call does."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from raystream.oip import grpc_predict_v2_pb2 as oip
    from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    address, _ = secure_server
    credentials = grpc.ssl_channel_credentials(
        pki["ca"].read_bytes(), pki["client_key"].read_bytes(), pki["client_cert"].read_bytes()
    )
    async with grpc.aio.secure_channel(address, credentials) as channel:
        inference = oip_grpc.GRPCInferenceServiceStub(channel)
        assert (await inference.ServerLive(oip.ServerLiveRequest(), timeout=10)).live
        assert (await inference.ServerReady(oip.ServerReadyRequest(), timeout=10)).ready
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await inference.ServerMetadata(oip.ServerMetadataRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
