"""Which model versions an application serves, shared by its replicas: the desired state
that load and unload change at run time, and what each replica reports it holds.

    desired   one key per version: "efficientnet-lite0/1" -> "serve", ... -> "drain"
    reports   one per replica, renewed while it lives: the versions it holds (stage
              replicas) or routes and has requests in flight for (ingress replicas)

Each version's state is a key of its own, so loads and unloads sent at once through
different ingress replicas change only their own versions: the store has no transactions,
and one document rewritten whole by two replicas would keep only the last one's change.

A version's life: `serve` (every stage replica loads and warms it, then reports it held; an
ingress routes to it once every live replica of every stage deployment holds it), `drain`
(ingresses stop routing to it; stage replicas keep it until no ingress reports requests in
flight for it), then gone (stage replicas drop it). The state lives in a registry actor of
the application instance that build_app names (serve_app/models/registry_actor.py): each
replica reads a copy of it kept current by a long poll, and writes to it; unit tests use a
MemoryStore. A report is renewed by its replica's reports and gone FRESH_S after the last,
on the store's clock alone: no two hosts' clocks are compared.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from serve_app.errors import ModelNotFound, clip
from serve_app.tuning import FRESH_S, START_WAIT_S

State = Literal["serve", "drain"]
REPORTS = "report/"  # the keys of the replicas' reports, under the instance: ephemeral


class Store(Protocol):
    """A key-value store whose keys under an instance's `report/` are ephemeral: each is
    gone FRESH_S after its last put, on the store's own clock."""

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        """Whether `key` was added (it had no value)."""

    def delete(self, key: str) -> None: ...
    def keys(self, prefix: str) -> list[str]: ...
    def close(self) -> None:
        """This process is done with the store."""


def ephemeral(key: str) -> bool:
    return key.split("/", 1)[-1].startswith(REPORTS)


class MemoryStore:
    """A Store in one process: unit tests, and the state a RegistryActor holds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.data: dict[str, bytes] = {}
        self.version = 0  # counts the changes of `data`
        self._clock = clock
        self._expires: dict[str, float] = {}  # ephemeral key -> when it is gone

    def get(self, key: str) -> bytes | None:
        self.expire()
        return self.data.get(key)

    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        self.expire()
        added = key not in self.data
        if ephemeral(key):
            self._expires[key] = self._clock() + FRESH_S
        if (overwrite or added) and self.data.get(key) != value:
            self.data[key] = value
            self.version += 1
        return added

    def delete(self, key: str) -> None:
        self._expires.pop(key, None)
        if self.data.pop(key, None) is not None:
            self.version += 1

    def keys(self, prefix: str) -> list[str]:
        self.expire()
        return [key for key in self.data if key.startswith(prefix)]

    def close(self) -> None:
        pass

    def expire(self) -> bool:
        """Drops the ephemeral keys not renewed in time; whether any went."""
        now = self._clock()
        gone = [key for key, until in self._expires.items() if until < now]
        for key in gone:
            self.delete(key)
        return bool(gone)


@dataclass(frozen=True)
class Report:
    deployment: str
    replica: str
    holds: frozenset[str]  # versions loaded (stage replicas) or routed and busy (ingress)
    failed: dict[str, str]  # versions that failed to load here, and why
    address: str = ""  # the replica's stage port, host:port (serve_app/transport/stage_port.py)
    node: str = ""  # the Ray node id of the replica's node
    unix: str = ""  # the stage port's Unix socket, for callers on that node


def key_of(name: str, version: str) -> str:
    return f"{name}/{version}"


def split_key(key: str) -> tuple[str, str]:
    name, _, version = key.partition("/")
    return name, version


def parse_model_name(asked: str) -> tuple[str, str]:
    """A client's "name" or "name/version" as (name, version); "name/", "/1" and "/" are
    neither (ModelNotFound): never the default model, nor every version."""
    if "/" not in asked:
        return asked, ""
    name, version = split_key(asked)
    if not (name and version):
        raise ModelNotFound(
            f'malformed model name {clip(asked)!r}: it is not "name" or "name/version"'
        )
    return name, version


class ModelRegistry:
    """The desired state and the replicas' reports of one application instance."""

    def __init__(self, store: Store, instance: str) -> None:
        self._store = store
        self._desired = f"{instance}/desired/"
        self._claimed = f"{instance}/start/claimed"
        self._written = f"{instance}/start/written"
        self._reports = f"{instance}/{REPORTS}"

    def start(self, initial: Iterable[str]) -> dict[str, State]:
        """The desired state. The instance's first replica writes it as `initial` (all
        served); the others wait until it has, so none serves an empty state at start,
        and none brings back a version unloaded since."""
        writer = self._store.put(self._claimed, b"", overwrite=False)
        deadline = time.monotonic() + START_WAIT_S
        while not writer and self._store.get(self._written) is None:
            writer = time.monotonic() > deadline  # the first replica died before writing it
            time.sleep(0.05)
        if writer:
            self.set_state(initial, "serve")
            self._store.put(self._written, b"")
        return self.desired()

    def desired(self) -> dict[str, State]:
        """Every version's state ("name/version" -> state)."""
        found: dict[str, State] = {}
        for key in self._store.keys(self._desired):
            state = self._store.get(key)
            if state is not None:  # removed since it was listed
                found[key.removeprefix(self._desired)] = state.decode()
        return found

    def set_state(self, keys: Iterable[str], state: State) -> None:
        for key in keys:
            self._store.put(self._desired + key, state.encode())

    def remove(self, keys: Iterable[str], only: State | None = None) -> None:
        """Stop desiring `keys` (those in state `only`, if given: a version that another
        replica loaded again meanwhile stays)."""
        for key in keys:
            if only is None or self._store.get(self._desired + key) == only.encode():
                self._store.delete(self._desired + key)

    def report(
        self,
        deployment: str,
        replica: str,
        holds: Iterable[str],
        failed: dict[str, str] | None = None,
        address: str = "",
        node: str = "",
        unix: str = "",
    ) -> None:
        value = {"holds": sorted(holds), "failed": failed or {}}
        for field, given in (("address", address), ("node", node), ("unix", unix)):
            if given:
                value[field] = given
        self._store.put(f"{self._reports}{deployment}/{replica}", json.dumps(value).encode())

    def leave(self, deployment: str, replica: str) -> None:
        """The replica is stopping: its report goes now, not FRESH_S later, and this process
        stops following the store."""
        self._store.delete(f"{self._reports}{deployment}/{replica}")
        self._store.close()

    def reports(self, deployment: str) -> list[Report]:
        """The reports of `deployment`'s live replicas (each renewed within FRESH_S)."""
        found = []
        for key in self._store.keys(f"{self._reports}{deployment}/"):
            raw = self._store.get(key)
            if raw is None:
                continue
            value = json.loads(raw)
            replica = key.rsplit("/", 1)[1]
            holds = frozenset(value["holds"])
            found.append(
                Report(
                    deployment,
                    replica,
                    holds,
                    value["failed"],
                    value.get("address", ""),
                    value.get("node", ""),
                    value.get("unix", ""),
                )
            )
        return found

    def ports(self, deployment: str) -> dict[str, frozenset[str]]:
        """The stage ports of `deployment`'s live replicas, each with the versions it holds."""
        return {
            report.address: report.holds for report in self.reports(deployment) if report.address
        }

    def sockets(self, deployment: str, node: str) -> dict[str, str]:
        """The Unix sockets of `deployment`'s live replicas on the node `node` (a Ray node
        id), by their stage ports' addresses."""
        return {
            report.address: report.unix
            for report in self.reports(deployment)
            if report.address and report.unix and node and report.node == node
        }

    def held_everywhere(self, deployments: Iterable[str]) -> set[str]:
        """The versions that every live replica of every deployment holds (none reported
        for a deployment: nothing)."""
        held: set[str] | None = None
        for deployment in deployments:
            for report in self.reports(deployment) or [Report(deployment, "", frozenset(), {})]:
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
