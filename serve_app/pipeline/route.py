"""The route of a request through the application's deployments: who calls whom, and how
the call travels. Worked out from the config alone, in this one place; the ready line,
`raystream info` (ModelInfo.route) and the ingress's log print it.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config import AppConfig, deployment_name, groups
from serve_app.transport.call_link import tls_contexts


@dataclass(frozen=True)
class Hop:
    caller: str  # a deployment
    callee: str
    transport: str

    def __str__(self) -> str:
        return f"{self.caller} -> {self.callee}: {self.transport}"


def route(config: AppConfig) -> tuple[Hop, ...]:
    """The hops of a request, in order. With `stage_calls: port` each deployment calls the
    next over its replicas' ports; with `handle`, the ingress chains the calls up to the
    deployment holding inference (through Ray's object store), which calls the rest."""
    names = [deployment_name(group) for group in groups(config)]
    if not names:  # direct: the ingress runs every stage itself
        return ()
    if config.stage_calls == "port":
        transport = f"stage port{' (TLS)' if tls_contexts() else ''}, else Serve handle"
        callers = ["Ingress", *names[:-1]]
        return tuple(Hop(a, b, transport) for a, b in zip(callers, names, strict=True))
    inference = next(i for i, group in enumerate(groups(config)) if "inference" in group)
    callers = ["Ingress"] * (inference + 1) + names[inference:-1]
    return tuple(Hop(a, b, "Serve handle") for a, b in zip(callers, names, strict=True))
