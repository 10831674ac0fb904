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
    balancers, Kubernetes probes and tools work without the token.

    `token`: what every other call needs (None: none). `control_token` (model_control's
    own): what model loads and unloads need instead, so that an inference client cannot
    unload the model served (None: they need `token`, as every other call)."""

    OPEN_PREFIXES = (
        "/grpc.health.v1.Health/",
        "/grpc.reflection.",
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    )
    CONTROL_METHODS = (
        "/inference.GRPCInferenceService/RepositoryModelLoad",
        "/inference.GRPCInferenceService/RepositoryModelUnload",
    )

    def __init__(self, token: str | None, control_token: str | None = None) -> None:
        for given, field in ((token, "auth_token_file"), (control_token, "token_file")):
            if given is not None and not given:
                raise ValueError(f"{field} is empty")
        self._expected = None if token is None else f"Bearer {token}".encode()
        self._control = None if control_token is None else f"Bearer {control_token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN_PREFIXES):
            return handler
        expected, message = self._expected, INFERENCE_TOKEN
        if self._control is not None and details.method in self.CONTROL_METHODS:
            expected, message = self._control, CONTROL_TOKEN
        if expected is None:
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), expected):
            return handler
        return _deny(handler, message)


INFERENCE_TOKEN = "missing or wrong bearer token in the 'authorization' metadata"
CONTROL_TOKEN = (
    "model loads and unloads need model_control's own bearer token in the 'authorization' "
    "metadata (model_control.token_file): missing or wrong"
)


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED and runs nothing."""

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
