"""The route of a request through the application's deployments: which deployments run which
stages, who calls whom, and how the call travels. `build_app` works it out from the config
once and hands it, in a `Wiring`, to every deployment: the ingress and the stage groups read
it rather than deciding again from the config; the ready line, `raystream info`
(ModelInfo.route) and the ingress's log print it.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Literal

from serve_app.config import AppConfig, Group, deployment_name, groups
from serve_app.transport.call_link import tls_contexts

INGRESS = "Ingress"
Transport = Literal["port", "handle"]


@dataclass(frozen=True)
class Hop:
    caller: str  # a deployment
    callee: str
    transport: Transport  # port: over the callee's stage port, else its Serve handle

    def __str__(self) -> str:
        if self.transport == "port":
            how = f"stage port{' (TLS)' if tls_contexts() else ''}, else Serve handle"
        else:
            how = "Serve handle"
        return f"{self.caller} -> {self.callee}: {how}"


@dataclass(frozen=True)
class Route:
    """The stage groups in order (none in topology direct: the ingress runs every stage
    itself) and the hops of a request between the deployments, in order."""

    groups: tuple[Group, ...]
    hops: tuple[Hop, ...]

    @property
    def deployments(self) -> tuple[str, ...]:
        """The stage deployments, in order."""
        return tuple(map(deployment_name, self.groups))

    @property
    def up_to_inference(self) -> tuple[str, ...]:
        """The deployments whose handles the ingress holds: those up to the one holding
        inference (it asks the last for what is served)."""
        return self.deployments[: _holding_inference(self.groups) + 1]

    @property
    def over_ports(self) -> bool:
        return any(hop.transport == "port" for hop in self.hops)

    def next_of(self, caller: str) -> Hop | None:
        """The call `caller` makes itself with its result (the ingress: its first call)."""
        return next((hop for hop in self.hops if hop.caller == caller), None)

    def serves_port(self, deployment: str) -> bool:
        """Whether `deployment`'s replicas are called over their stage ports."""
        return any(hop.callee == deployment and hop.transport == "port" for hop in self.hops)

    def __str__(self) -> str:
        return "; ".join(map(str, self.hops)) or "the ingress runs every stage"


def route(config: AppConfig) -> Route:
    """The route of `config`. With `stage_ports` each deployment calls the next over its
    replicas' ports; without, the ingress chains the calls up to the deployment holding
    inference (through Ray's object store), which calls the rest."""
    stage_groups = groups(config)
    names = [deployment_name(group) for group in stage_groups]
    if not names:  # direct: the ingress runs every stage itself
        return Route((), ())
    if config.stage_ports is not None:
        callers = [INGRESS, *names[:-1]]
        hops = (Hop(a, b, "port") for a, b in zip(callers, names, strict=True))
        return Route(stage_groups, tuple(hops))
    inference = _holding_inference(stage_groups)
    callers = [INGRESS] * (inference + 1) + names[inference:-1]
    hops = (Hop(a, b, "handle") for a, b in zip(callers, names, strict=True))
    return Route(stage_groups, tuple(hops))


def _holding_inference(stage_groups: tuple[Group, ...]) -> int:
    """The index of the stage group that runs inference."""
    return next(i for i, group in enumerate(stage_groups) if "inference" in group)


@dataclass(frozen=True)
class Wiring:
    """What build_app works out for the replicas of one deployment of the application and
    hands each of them beside the config: the route, and two values no person sets."""

    route: Route
    # Names the shared state the replicas keep about the models loaded at run time
    # (serve_app/models/registry_actor.py): one per deployment of the application.
    instance: str
    # The secret from which stage calls over the replicas' ports derive their keys
    # (serve_app/transport/stage_port.py); never sent.
    stage_token: str

    @classmethod
    def of(cls, config: AppConfig) -> Wiring:
        return cls(route(config), uuid.uuid4().hex, secrets.token_hex(16))
