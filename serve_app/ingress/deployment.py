"""The Ingress deployment: a grpc.aio server inside a Serve replica, terminating client
streams for raystream.v1 (serve_app/protocol/v1.py) and the Open Inference Protocol
(serve_app/protocol/oip.py),
with health and reflection, on the serving core (serve_app/core/serving.py).

Ray Serve's own gRPC proxy costs about 18x a plain grpc.aio server per bidi message, so the
ingress runs its own server on the replica's event loop. It sends micro-batches of requests
through the stage deployments as a chain of handle calls (topology.py, StageChain);
in topology `direct` it runs the stages itself. This layer (with v1.py, oip.py and
security.py) is the only one that imports grpc and turns errors into status codes.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from ray import serve
from ray.serve.handle import DeploymentHandle

from raystream.oip import grpc_predict_v2_pb2 as oip
from serve_app.config import STAGES, AppConfig
from serve_app.core.dispatch_rule import Fleet, host_cores
from serve_app.core.messages import Served
from serve_app.core.serving import ServingCore
from serve_app.ingress.security import TokenAuth, server_credentials
from serve_app.models.lifecycle import ROUTES, ModelLifecycle
from serve_app.models.registry import ModelRegistry
from serve_app.models.registry_actor import ActorStore
from serve_app.observability import tracing
from serve_app.observability.logs import to_serve_log
from serve_app.observability.metrics import resident_memory_bytes
from serve_app.pipeline.route import INGRESS, Wiring
from serve_app.pipeline.topology import (
    StageChain,
    StageGroup,
    drain_timeout_s,
    initial_versions,
)
from serve_app.protocol import v1
from serve_app.protocol.oip import OpenInferenceService
from serve_app.protocol.streams import StreamRunner
from serve_app.tuning import LOAD_TIMEOUT_S, POLL_S, SHARED_IMAGES_BYTES

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    v1.SERVICE,
    oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    health.SERVICE_NAME,
)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=8)
class Ingress:
    """Starts the gRPC server in this replica; it serves until the replica stops.

    `stages`: the handles of the stage deployments up to the one holding inference, in
    order (serve_app/pipeline/topology.py, StageChain); none in topology `direct`,
    where this replica runs the stages and takes the batching `user_config` that the
    Inference deployment takes otherwise."""

    async def __init__(self, config: dict, wiring: Wiring, *stages: DeploymentHandle) -> None:
        to_serve_log()
        self._server: grpc.aio.Server | None = None
        self._config = AppConfig.model_validate(config)
        self._drain_s = drain_timeout_s()
        route = wiring.route
        tracing.configure(self._config.tracing, "Ingress")
        self._local: StageGroup | None = None
        self._chain: StageChain | None = None
        replica = serve.get_replica_context().replica_id.unique_id
        registry = ModelRegistry(ActorStore(wiring.instance), wiring.instance)
        self._registry = registry
        first_hop = route.next_of(INGRESS)
        self._callee = "" if first_hop is None else first_hop.callee  # "": runs the stages
        self._cores = host_cores()
        if stages:
            # Over the ports, images go to stage replicas on this node through shared memory.
            port = route.over_ports
            chain = StageChain(
                list(stages),
                registry if port else None,
                wiring.stage_token,
                ray.util.get_node_ip_address(),
                SHARED_IMAGES_BYTES if port else 0,
                node_id=ray.get_runtime_context().get_node_id(),
            )
            logger.info("stage calls from the ingress: %s", chain.transport)
            logger.info("the route: %s", route)
            info, run = chain.info, chain.run
            self._chain = chain
            stage_deployments = set(route.deployments)
        else:
            self._local = await StageGroup.create(
                self._config, STAGES, registry, "Ingress", replica
            )
            info = self._local_info
            run = self._local.run
            stage_deployments = {"Ingress"}
        limits = self._config.limits
        # a stream buffers at most what one message may carry
        self._streams = StreamRunner(limits.max_in_flight_per_stream, limits.max_message_bytes)
        self._core = ServingCore(self._config, [], run, self._fleet)
        self._core.stage_transport = "local" if self._chain is None else self._chain.transport
        self._models = ModelLifecycle(
            self._core,
            registry,
            stage_deployments,
            replica,
            info,
            self._config.model_repository,
            self._config.model_entries,
            self._drain_s,
            LOAD_TIMEOUT_S,
        )
        wanted = registry.start(initial_versions(self._config))
        while not all(key in self._core.models for key in wanted):  # the stages warm up
            await self._models.follow_once()
            await asyncio.sleep(POLL_S)
        self._models.start()
        model = self._core.check_model("")
        security = self._config.security
        interceptors = []
        control = self._config.model_control
        token, control_token = (
            None if path is None else path.read_text().strip()
            for path in (security.auth_token_file, control.token_file)
        )
        if token is not None or control_token is not None:
            interceptors.append(TokenAuth(token, control_token))
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
        self._server.add_generic_rpc_handlers(
            (
                v1.ClassifierService(
                    self._core, self._streams, tuple(map(str, route.hops))
                ).handler(),
            )
        )
        self._server.add_generic_rpc_handlers(
            (
                OpenInferenceService(
                    self._core, self._streams, self._models, control.enabled
                ).handler(),
            )
        )
        # grpc.health.v1 (SERVING once the engine is warm) and server reflection, so
        # grpcurl-style tools list and call the services.
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), self._server)
        address = f"{self._config.host}:{self._config.port}"
        credentials = server_credentials(security)
        if credentials is None:
            self._port = self._server.add_insecure_port(address)
        else:
            self._port = self._server.add_secure_port(address, credentials)
        if self._port == 0:
            raise RuntimeError(f"cannot bind gRPC to {address}: is the port in use?")
        await self._server.start()
        for service_name in ("", *SERVICE_NAMES):
            await self._health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "ingress replica listening: gRPC on %s:%d, serving %s/%s on %s (%s)",
            self._config.host,
            self._port,
            model.name,
            model.version,
            model.engine.engine,
            model.engine.device,
        )

    def _fleet(self) -> Fleet:
        """The replicas that report to the registry now (a local read): those of the
        deployment this replica calls, and the ingress replicas (core/dispatch_rule.py)."""
        callee = len(self._registry.reports(self._callee)) if self._callee else 1
        return Fleet(max(callee, 1), max(len(self._registry.reports(ROUTES)), 1), self._cores)

    async def _local_info(self, key: str) -> Served:
        return self._local.info(key)

    async def reconfigure(self, user_config: dict) -> None:
        if self._local is None:
            raise ValueError(
                "Ingress takes a user_config only in topology: direct; put batching "
                "settings on the Inference deployment"
            )
        self._local.reconfigure(user_config)

    async def check_health(self) -> None:
        """Serve's health check: in topology direct, fails while an engine or nvJPEG call is
        stuck (StageGroup); Serve then replaces this replica, its streams with it."""
        if self._local is not None:
            self._local.check_health()

    def batching(self) -> dict:
        """topology direct: the batching settings in force (Inference.batching otherwise)."""
        if self._local is None:
            raise ValueError("batching lives on the Inference deployment outside topology direct")
        return self._local.batching()

    def port(self) -> int:
        return self._port

    def requests_started(self) -> int:
        """Requests that reached the pipeline (tests: rejected calls must not count)."""
        return self._core.requests_started

    def pid(self) -> int:
        """This replica's process (tests: whose shared-memory segments are whose)."""
        return os.getpid()

    def memory_bytes(self) -> int:
        """Resident memory of this replica's process (soak test)."""
        return resident_memory_bytes()

    def requests_in_flight(self) -> int:
        """Requests being answered now (tests: disconnects must leave none)."""
        return self._core.requests_in_flight

    async def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica (delete, redeploy, scale-down):
        # report NOT_SERVING so balancers move on, refuse new calls, stop reading streams,
        # and give what was read the drain timeout (serve_app/tuning.py) to be answered.
        if self._server is not None:
            self._models.stop()  # no registry poll runs into the process's shutdown
            if self._chain is not None:
                self._chain.stop()  # nor a read of the stage ports' addresses
            await self._health.enter_graceful_shutdown()
            self._streams.drain()
            await self._server.stop(grace=self._drain_s)
            if self._chain is not None:
                await self._chain.close()
            await self._models.leave()
            self._core.flush_metrics()  # the last second's counts
