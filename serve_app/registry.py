"""Which model versions an application serves, shared by its replicas: the desired state
that load and unload change at run time, and what each replica reports it holds.

    desired   {"efficientnet-lite0/1": "serve", "efficientnet-lite0/2": "serve"}
    reports   one per replica, rewritten every POLL_S: the versions it holds (stage
              replicas) or routes and has requests in flight for (ingress replicas)

A version's life: `serve` (every stage replica loads and warms it, then reports it held; an
ingress routes to it once every live replica of every stage deployment holds it), `drain`
(ingresses stop routing to it; stage replicas keep it until no ingress reports requests in
flight for it), then gone (stage replicas drop it). The state lives in Ray's GCS key-value
store (RayStore), under the application instance that build_app names; unit tests use a
MemoryStore.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

State = Literal["serve", "drain"]
POLL_S = 0.25  # how often replicas read the desired state and write their report
FRESH_S = 5.0  # a report older than this is from a replica that is gone


class Store(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes, overwrite: bool = True) -> None: ...
    def keys(self, prefix: str) -> list[str]: ...


class MemoryStore:
    """A Store in one process (unit tests, or several objects that share it)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes, overwrite: bool = True) -> None:
        if overwrite or key not in self.data:
            self.data[key] = value

    def keys(self, prefix: str) -> list[str]:
        return [key for key in self.data if key.startswith(prefix)]


class RayStore:
    """The Ray cluster's GCS key-value store: every replica of the application sees it."""

    NAMESPACE = "raystream"

    def get(self, key: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=self.NAMESPACE)

    def put(self, key: str, value: bytes, overwrite: bool = True) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite, namespace=self.NAMESPACE)

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental import internal_kv

        found = internal_kv._internal_kv_list(prefix, namespace=self.NAMESPACE)
        return [key.decode() if isinstance(key, bytes) else key for key in found]


@dataclass(frozen=True)
class Report:
    deployment: str
    replica: str
    holds: frozenset[str]  # versions loaded (stage replicas) or routed and busy (ingress)
    at: float
    failed: dict[str, str]  # versions that failed to load here, and why
    address: str = ""  # the replica's stage port, host:port (serve_app/stage_port.py)


def key_of(name: str, version: str) -> str:
    return f"{name}/{version}"


def split_key(key: str) -> tuple[str, str]:
    name, _, version = key.partition("/")
    return name, version


class ModelRegistry:
    """The desired state and the replicas' reports of one application instance."""

    def __init__(self, store: Store, instance: str) -> None:
        self._store = store
        self._desired_key = f"{instance}/desired"
        self._reports = f"{instance}/report/"

    def start(self, initial: Iterable[str]) -> dict[str, State]:
        """The desired state; written as `initial` (all served) by the first replica."""
        value = json.dumps(dict.fromkeys(sorted(initial), "serve")).encode()
        self._store.put(self._desired_key, value, overwrite=False)
        return self.desired()

    def desired(self) -> dict[str, State]:
        raw = self._store.get(self._desired_key)
        return {} if raw is None else json.loads(raw)

    def set_desired(self, desired: dict[str, State]) -> None:
        self._store.put(self._desired_key, json.dumps(desired, sort_keys=True).encode())

    def report(
        self,
        deployment: str,
        replica: str,
        holds: Iterable[str],
        failed: dict[str, str] | None = None,
        address: str = "",
    ) -> None:
        value = {"holds": sorted(holds), "at": time.time(), "failed": failed or {}}
        if address:
            value["address"] = address
        self._store.put(f"{self._reports}{deployment}/{replica}", json.dumps(value).encode())

    def reports(self, deployment: str) -> list[Report]:
        """The fresh reports of `deployment`'s replicas."""
        now, found = time.time(), []
        for key in self._store.keys(f"{self._reports}{deployment}/"):
            raw = self._store.get(key)
            if raw is None:
                continue
            value = json.loads(raw)
            if now - value["at"] <= FRESH_S:
                replica = key.rsplit("/", 1)[1]
                holds = frozenset(value["holds"])
                found.append(
                    Report(
                        deployment,
                        replica,
                        holds,
                        value["at"],
                        value["failed"],
                        value.get("address", ""),
                    )
                )
        return found

    def addresses(self, deployment: str) -> list[str]:
        """The stage ports of `deployment`'s live replicas that report one."""
        return [report.address for report in self.reports(deployment) if report.address]

    def held_everywhere(self, deployments: Iterable[str]) -> set[str]:
        """The versions that every live replica of every deployment holds (none reported
        for a deployment: nothing)."""
        held: set[str] | None = None
        for deployment in deployments:
            for report in self.reports(deployment) or [Report(deployment, "", frozenset(), 0, {})]:
                held = set(report.holds) if held is None else held & report.holds
        return held or set()

    def failures(self, deployments: Iterable[str]) -> dict[str, str]:
        """Versions some live replica failed to load, and why."""
        found: dict[str, str] = {}
        for deployment in deployments:
            for report in self.reports(deployment):
                found.update(report.failed)
        return found

    def held_anywhere(self, deployment: str) -> set[str]:
        """The versions some live replica of `deployment` reports."""
        return set().union(*(report.holds for report in self.reports(deployment)))
