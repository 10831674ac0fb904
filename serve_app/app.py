"""The application builder: `serve run serve_app.app:build_app` or a Serve config file.

The topology (serve_app/pipeline/topology.py) says which deployments run the stages; each group is
one `Stages` deployment named for its main stage, and the Ingress gets their handles in order.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig, BatchingConfig, Group, deployment_name
from serve_app.core.messages import Answer, Batch, Served
from serve_app.ingress.deployment import Ingress
from serve_app.models.registry import ModelRegistry
from serve_app.models.registry_actor import ActorStore
from serve_app.observability.logs import to_serve_log
from serve_app.observability.metrics import StageCallMetrics, StageMetrics
from serve_app.pipeline.autoscaling import PORT_CALLS
from serve_app.pipeline.route import Wiring
from serve_app.pipeline.topology import (
    StageGroup,
    StageHandle,
    drain_timeout_s,
    initial_versions,
)
from serve_app.transport.stage_port import PortCalls, StagePort

# Topology direct: the replica runs raystream on Serve's own event loop, not on a second
# loop in a second thread (Ray Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED does the same): the
# gRPC server and Serve's replica machinery then stop contending for the GIL from two
# threads. Safe because nothing in the replica blocks its loop (decode and engine run in
# threads). A value already in the environment (a config's runtime_env) wins.
DIRECT_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}

# Each group deployment's defaults, by name; a Serve config's `deployments:` entry of the
# same name overrides them.
DEFAULTS = {
    "Preprocess": {"ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 32},
    "Inference": {
        "ray_actor_options": {"num_cpus": 0.5},
        "max_ongoing_requests": 64,
        "user_config": BatchingConfig().model_dump(),
    },
    "Postprocess": {"ray_actor_options": {"num_cpus": 0.25}, "max_ongoing_requests": 64},
}


@serve.deployment
class Stages:
    """A group of stages as a Serve deployment: a thin shell over StageGroup. The ingress
    chains the calls of the groups up to the one holding inference (serve_app/pipeline/topology.py,
    StageChain); that group passes its result on to the group after it (`next`) itself.
    Where the route says so (`stage_ports`), every group passes its result on to the next,
    over the next group's ports, and serves its own port (serve_app/transport/stage_port.py)."""

    async def __init__(
        self, config: dict, wiring: Wiring, stages: Group, next: DeploymentHandle | None
    ) -> None:
        to_serve_log()
        config = AppConfig.model_validate(config)
        context = serve.get_replica_context()
        name = deployment_name(stages)
        registry = ModelRegistry(ActorStore(wiring.instance), wiring.instance)
        self._drain_s = drain_timeout_s()
        node_id = ray.get_runtime_context().get_node_id()
        self._port = None
        self._port_calls_here = 0  # port calls in this group's own stages (autoscaling)
        self._handle_calls_here = 0  # `run` calls by handle in flight (the port's bound)
        self._metrics = StageMetrics()
        if wiring.route.serves_port(name):
            self._port = StagePort(
                self._run_port_call,
                wiring.stage_token,
                name,
                then=self._pass_on,
                max_calls=_max_ongoing_requests,
                handle_calls=lambda: self._handle_calls_here,
            )
            first, last = config.stage_ports
            await self._port.start(ray.util.get_node_ip_address(), range(first, last + 1))
        self._group = await StageGroup.create(
            config,
            stages,
            registry,
            name,
            context.replica_id.unique_id,
            "" if self._port is None else self._port.address,
            node=node_id,
            unix="" if self._port is None else self._port.unix,
        )
        self._next = None
        if next is not None:
            self._next = StageHandle(next)
            hop = wiring.route.next_of(name)
            if hop is not None and hop.transport == "port":
                self._next = PortCalls(
                    registry,
                    hop.callee,
                    self._next.run,
                    wiring.stage_token,
                    node=ray.util.get_node_ip_address(),  # crops on the GPU: this node's only
                    metrics=StageCallMetrics(),
                    node_id=node_id,
                )
        self.batching = self._group.batching
        self.images_inferred = self._group.images_inferred
        self.memory_bytes = self._group.memory_bytes

    async def run(self, batch: Batch) -> Batch | list[Answer]:
        self._handle_calls_here += 1
        try:
            return await self._pass_on(await self._group.run(batch, "handle"))
        finally:
            self._handle_calls_here -= 1

    async def _run_port_call(self, batch: Batch) -> Batch:
        """This group's part of a call over the port, counted while its own stages hold it
        (Serve's autoscaler, serve_app/pipeline/autoscaling.py); the port then passes the result on
        (`_pass_on`), no longer counted."""
        self._port_calls_here += 1
        self._metrics.port_calls.set(self._port_calls_here)
        try:
            return await self._group.run(batch, "port")
        finally:
            self._port_calls_here -= 1
            self._metrics.port_calls.set(self._port_calls_here)

    async def _pass_on(self, batch: Batch) -> Batch | list[Answer]:
        return batch if self._next is None else await self._next.run(batch)

    async def info(self, key: str = "") -> Served:
        """What is served: a model version ("name/version"; empty: the default model) and
        its engine (the group that holds inference answers)."""
        return self._group.info(key)

    async def reconfigure(self, user_config: dict) -> None:
        self._group.reconfigure(user_config)

    async def check_health(self) -> None:
        """Serve's health check: fails while an engine or nvJPEG call is stuck (StageGroup).
        On the event loop, where the group's models change, not on Serve's threads."""
        self._group.check_health()

    async def __del__(self) -> None:
        # Serve calls it when it stops the replica: stop polling the registry and the next
        # group's addresses first, so that no poll runs into the process's shutdown; calls
        # over the port get the drain timeout.
        self._group.stop()
        if isinstance(self._next, PortCalls):
            self._next.stop()
        if self._port is not None:
            await self._port.stop(self._drain_s)
        if isinstance(self._next, PortCalls):
            await self._next.close()
        await self._group.leave()

    def record_autoscaling_stats(self) -> dict[str, int]:
        """Serve's autoscaler reads it (serve_app/pipeline/autoscaling.py): the port's calls
        here."""
        return {PORT_CALLS: self._port_calls_here}

    def port_calls(self) -> int:
        """Calls answered over this replica's stage port (tests: the port carried them)."""
        return 0 if self._port is None else self._port.calls

    def handle_calls(self) -> int:
        """Calls this replica made to the next deployment by Serve handle, not over a port
        (tests: Serve's own count of the next deployment's requests saw only these)."""
        return self._next.by_handle if isinstance(self._next, PortCalls) else 0

    def replica_id(self) -> str:
        """This replica's Serve id (operators and tests: which replica answered)."""
        return serve.get_replica_context().replica_id.unique_id


def _max_ongoing_requests() -> int:
    """The deployment's `max_ongoing_requests` as Serve holds it now (a config change sets it
    in place): the port bounds its calls by it too. Ray keeps it in the replica context's
    deployment config, a private field; 0 (no bound) where a Ray version lacks it."""
    config = getattr(serve.get_replica_context(), "_deployment_config", None)
    return getattr(config, "max_ongoing_requests", 0) or 0


def build_app(args: dict[str, Any]) -> Application:
    """Validate the config and fail now (before any replica starts) if the model is missing;
    work out the route once and bind the deployments it names, each given it (`Wiring`)."""
    config = AppConfig.model_validate(args)
    if not initial_versions(config):
        raise ValueError("no model version to serve")
    shared = config.model_dump(mode="json")
    wiring = Wiring.of(config)
    route = wiring.route
    if not route.groups:
        # A config file's ray_actor_options replace these, and with them this runtime_env:
        # `raystream serve` and the direct configs in deploy/ set the variable themselves.
        env_vars = {name: os.environ.get(name, value) for name, value in DIRECT_REPLICA_ENV.items()}
        options = {**Ingress.ray_actor_options, "runtime_env": {"env_vars": env_vars}}
        return Ingress.options(ray_actor_options=options).bind(shared, wiring)

    # Each group is given the handle of the deployment it calls itself (the route's hop
    # from it), the last first; the ingress holds those up to the one holding inference.
    bound: dict[str, Application] = {}
    for group in reversed(route.groups):
        name = deployment_name(group)
        hop = route.next_of(name)
        calls = None if hop is None else bound[hop.callee]
        bound[name] = Stages.options(name=name, **DEFAULTS[name]).bind(shared, wiring, group, calls)
    return Ingress.bind(shared, wiring, *(bound[name] for name in route.up_to_inference))
