"""TLS and bearer-token authentication for the gRPC ingress (README: Deploying safely)."""

from __future__ import annotations

import hmac

import grpc

from serve_app.config import SecurityConfig


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    if security.tls_cert is None:
        return None
    ca = security.tls_client_ca.read_bytes() if security.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(security.tls_key.read_bytes(), security.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


class TokenAuth(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` before any handler runs. Liveness and readiness
    probes stay open (grpc.health.v1 and the Open Inference Protocol's ServerLive and
    ServerReady: they tell nothing but up or down), and so does reflection, so that load
    balancers, Kubernetes probes and tools work without the token."""

    OPEN_PREFIXES = (
        "/grpc.health.v1.Health/",
        "/grpc.reflection.",
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    )

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth_token_file is empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN_PREFIXES):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED and runs nothing."""
    message = "missing or wrong bearer token in the 'authorization' metadata"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable: makes this an async generator, as streaming handlers are

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
