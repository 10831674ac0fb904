"""The gRPC ingress: a grpc.aio server inside a Serve replica, terminating client streams.

Ray Serve's own gRPC proxy costs about 18x a plain grpc.aio server per bidi message
(../shared/FINDINGS.md), so the ingress deployment runs its own grpc.aio server on the
replica's event loop, serving raystream.v1 (serve_app/classifier.py), the Open Inference
Protocol (serve_app/oip.py), health and reflection. It reaches the pipeline through
DeploymentHandles; one request (all of its images) costs one Ray call (topology `fused`),
three (`chained`) or none (`direct`, the model in this replica): serve_app/pipeline.py.

The ingress layer (this module, classifier.py, oip.py for the Open Inference Protocol,
security.py for TLS and tokens) is the only place that imports grpc and turns errors into
status codes.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from ray import serve
from ray.serve.handle import DeploymentHandle

from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc
from serve_app.classifier import ClassifierService
from serve_app.config import AppConfig
from serve_app.inference import Inference
from serve_app.metrics import resident_memory_bytes
from serve_app.oip import OpenInferenceService
from serve_app.pipeline import ChainedPipeline, FusedPipeline, LocalPipeline, Pipeline
from serve_app.security import TokenAuth, server_credentials

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["ImageClassifier"].full_name,
    oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    health.SERVICE_NAME,
)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=8)
class Ingress:
    """Starts the gRPC server in this replica; it serves until the replica stops.

    Without an `inference` handle (topology `direct`) the replica hosts the model itself and
    takes the batching `user_config` that the Inference deployment takes otherwise."""

    async def __init__(
        self,
        config: dict,
        inference: DeploymentHandle | None = None,
        preprocess: DeploymentHandle | None = None,
        postprocess: DeploymentHandle | None = None,
    ) -> None:
        self._server: grpc.aio.Server | None = None
        self._config = AppConfig.model_validate(config)
        self._local: Inference | None = None
        if inference is None:
            self._local = await Inference.func_or_class.in_process(config)
            model = self._local.info()
            pipeline: Pipeline = LocalPipeline(self._config, self._local)
        else:
            model = await inference.info.remote()
            if preprocess is not None and postprocess is not None:
                pipeline = ChainedPipeline(self._config, preprocess, inference, postprocess)
            else:
                pipeline = FusedPipeline(self._config, inference)
        limits = self._config.limits
        security = self._config.security
        interceptors = []
        if security.auth_token_file is not None:
            interceptors.append(TokenAuth(security.auth_token_file.read_text().strip()))
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limits.max_message_bytes),
                ("grpc.max_send_message_length", limits.max_message_bytes),
                # A redeploy starts the new ingress replica while the old one still drains
                # (max_surge_percent): both listen on the port until the old one stops.
                ("grpc.so_reuseport", 1),
            ],
        )
        self._service = ClassifierService(self._config, model, pipeline)
        pb_grpc.add_ImageClassifierServicer_to_server(self._service, self._server)
        oip_grpc.add_GRPCInferenceServiceServicer_to_server(
            OpenInferenceService(self._service), self._server
        )
        # grpc.health.v1 (SERVING: the engine was warmed before Inference reported ready)
        # and server reflection, so grpcurl-style tools list and call the services.
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), self._server)
        address = f"{self._config.host}:{self._config.port}"
        credentials = server_credentials(self._config.security)
        if credentials is None:
            self._port = self._server.add_insecure_port(address)
        else:
            self._port = self._server.add_secure_port(address, credentials)
        if self._port == 0:
            raise RuntimeError(f"cannot bind gRPC to {address}: is the port in use?")
        await self._server.start()
        for service_name in ("", *SERVICE_NAMES):
            await self._health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
        name, version, engine = model
        logger.info(
            "raystream ready: gRPC on %s:%d serving %s/%s on %s (%s)",
            self._config.host,
            self._port,
            name,
            version,
            engine.engine,
            engine.device,
        )

    def reconfigure(self, user_config: dict) -> None:
        if self._local is None:
            raise ValueError(
                "Ingress takes a user_config only in topology: direct; put batching "
                "settings on the Inference deployment"
            )
        self._local.reconfigure(user_config)

    def batching(self) -> dict:
        """topology direct: the batching settings in force (Inference.batching otherwise)."""
        if self._local is None:
            raise ValueError("batching lives on the Inference deployment outside topology direct")
        return self._local.batching()

    def port(self) -> int:
        return self._port

    def requests_started(self) -> int:
        """Requests that reached the pipeline (tests: rejected calls must not count)."""
        return self._service.requests_started

    def memory_bytes(self) -> int:
        """Resident memory of this replica's process (soak test)."""
        return resident_memory_bytes()

    def requests_in_flight(self) -> int:
        """Requests being answered now (tests: disconnects must leave none)."""
        return self._service.requests_in_flight

    async def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica (delete, redeploy, scale-down):
        # report NOT_SERVING so balancers move on, refuse new calls, stop reading streams,
        # and give what was read `drain_timeout_s` to be answered.
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            self._service.drain()
            await self._server.stop(grace=self._config.limits.drain_timeout_s)
            self._service.flush_metrics()  # the last second's counts
