"""The registry's store on a Ray cluster: one actor per application instance holds it, and
each replica keeps a copy that a long poll keeps current.

    replica --put / delete (a write, when it changes)----------> RegistryActor
    replica --put of an unchanged report (every HEARTBEAT_S)---> (renews it; answers the
                                                                  store only if it changed)
    replica <--watch(version): the whole store once it changes-- (a call held up to WATCH_S)

So a replica reads the state from memory, writes only what changed plus a heartbeat a
second, and none polls: in steady state each makes one call a HEARTBEAT_S and holds one
watch. The actor drops a report FRESH_S after its last renewal, on its own clock. The
desired state (a few keys that load and unload change) is also written to Ray's GCS
key-value store, so a registry actor that restarts (its node lost) starts from it; the
reports come back with the next heartbeats. Once no replica has reported for IDLE_EXIT_S
(the application is gone), the actor removes its keys from the GCS and exits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid

import ray

from serve_app.models.registry import MemoryStore, ephemeral
from serve_app.tuning import EXPIRE_S, HEARTBEAT_S, IDLE_EXIT_S, WATCH_S

logger = logging.getLogger(__name__)

NAMESPACE = "raystream"

Snapshot = tuple[str, int, dict[str, bytes]]  # (the actor's epoch, its version, the store)


def actor_name(instance: str) -> str:
    return f"raystream-registry-{instance}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class RegistryActor:
    """One application instance's store (a MemoryStore), its watches and its GCS copy."""

    def __init__(self, instance: str) -> None:
        self._prefix = f"{instance}/"
        self._store = MemoryStore()
        self._epoch = uuid.uuid4().hex  # a restarted actor counts its versions anew
        self._changed: asyncio.Event | None = None
        self._expiring: asyncio.Task | None = None
        self._last_report = time.monotonic()
        self._calls: collections.Counter[str] = collections.Counter()  # by method (tests)
        for key in _gcs_keys(self._prefix):  # after a restart: the desired state kept
            value = _Gcs.get(key, namespace=NAMESPACE)
            if value is not None:
                self._store.data[key] = value

    def _started(self) -> asyncio.Event:
        if self._changed is None:  # on the actor's event loop, at its first call
            self._changed = asyncio.Event()
            self._expiring = asyncio.get_running_loop().create_task(self._expire())
        return self._changed

    def calls(self) -> dict[str, int]:
        return dict(self._calls)

    async def snapshot(self) -> Snapshot:
        self._calls["snapshot"] += 1
        return self._snapshot()

    def _snapshot(self) -> Snapshot:
        self._started()
        self._store.expire()
        return self._epoch, self._store.version, dict(self._store.data)

    async def watch(self, epoch: str, version: int, timeout_s: float) -> Snapshot:
        """The store once it differs from (`epoch`, `version`), or after `timeout_s`."""
        self._calls["watch"] += 1
        changed = self._started()
        deadline = time.monotonic() + timeout_s
        while (epoch, version) == (self._epoch, self._store.version):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return self._snapshot()

    async def put(
        self, key: str, value: bytes, overwrite: bool = True, known: tuple[str, int] | None = None
    ) -> tuple[bool, Snapshot | None]:
        """Writes `key`; the store for the writer's copy, or None where the write changed
        nothing and `known` (the copy's epoch and version) is current: a heartbeat's answer
        stays small however many replicas report."""
        self._calls["put"] += 1
        version = self._expire_now()
        added = self._store.put(key, value, overwrite)
        if ephemeral(key):
            self._last_report = time.monotonic()
        elif self._store.version != version:
            _Gcs.put(key, value, True, namespace=NAMESPACE)
        self._notify(version)
        return added, self._answer(known, version)

    async def delete(self, key: str, known: tuple[str, int] | None = None) -> Snapshot | None:
        self._calls["delete"] += 1
        version = self._expire_now()
        self._store.delete(key)
        if not ephemeral(key) and self._store.version != version:
            _Gcs.delete(key, namespace=NAMESPACE)
        self._notify(version)
        return self._answer(known, version)

    def _expire_now(self) -> int:
        """Drops the reports past their time (the watches told); the version after."""
        version = self._store.version
        self._store.expire()
        self._notify(version)
        return self._store.version

    def _answer(self, known: tuple[str, int] | None, before: int) -> Snapshot | None:
        unchanged = self._store.version == before
        if unchanged and known is not None and tuple(known) == (self._epoch, before):
            return None  # the writer's copy is current
        return self._snapshot()

    def _notify(self, version: int) -> None:
        if self._store.version != version:
            self._started().set()

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_S)
            version = self._store.version
            self._store.expire()
            self._notify(version)
            if time.monotonic() - self._last_report > IDLE_EXIT_S:
                logger.info(
                    "no replica of %s reported for %.0f s: exiting", self._prefix, IDLE_EXIT_S
                )
                for key in _gcs_keys(self._prefix):
                    _Gcs.delete(key, namespace=NAMESPACE)
                ray.actor.exit_actor()


class _Gcs:
    """Ray's GCS key-value store, where the desired state is kept across actor restarts."""

    @staticmethod
    def get(key: str, namespace: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=namespace)

    @staticmethod
    def put(key: str, value: bytes, overwrite: bool, namespace: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite, namespace=namespace)

    @staticmethod
    def delete(key: str, namespace: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=namespace)


def _gcs_keys(prefix: str) -> list[str]:
    from ray.experimental import internal_kv

    found = internal_kv._internal_kv_list(prefix, namespace=NAMESPACE)
    return [key.decode() if isinstance(key, bytes) else key for key in found]


class ActorStore:
    """A Store (serve_app/models/registry.py) over the instance's RegistryActor: reads from
    a copy kept current by a watch in a thread of its own, and by each write's answer;
    writes go to the actor. An unchanged report goes at most every HEARTBEAT_S."""

    def __init__(self, instance: str) -> None:
        self._actor = RegistryActor.options(
            name=actor_name(instance),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            # on the head node where there is one: it goes with the cluster, not a worker
            resources={"node:__internal_head__": 0.001} if _has_head_resource() else None,
        ).remote(instance)
        self._lock = threading.Lock()
        self._epoch, self._version, self._data = ray.get(self._actor.snapshot.remote())
        self._sent: dict[str, tuple[bytes, float]] = {}  # report -> (value, when sent)
        self._stopped = threading.Event()
        self._watching = threading.Thread(target=self._watch, name="registry-watch", daemon=True)
        self._watching.start()

    def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def keys(self, prefix: str) -> list[str]:
        return [key for key in self._data if key.startswith(prefix)]

    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        if ephemeral(key):
            last, now = self._sent.get(key), time.monotonic()
            if last is not None and last[0] == value and now - last[1] < HEARTBEAT_S:
                return False  # renewed less than a heartbeat ago, and unchanged
            self._sent[key] = (value, now)
        added, snapshot = ray.get(self._actor.put.remote(key, value, overwrite, self._known()))
        self._adopt(snapshot)
        return added

    def delete(self, key: str) -> None:
        self._sent.pop(key, None)
        self._adopt(ray.get(self._actor.delete.remote(key, self._known())))

    def _known(self) -> tuple[str, int]:
        with self._lock:
            return self._epoch, self._version

    def _adopt(self, snapshot: Snapshot | None) -> None:
        """Takes `snapshot` unless the copy is newer already (a watch and a write race);
        None: the copy is current."""
        if snapshot is None:
            return
        epoch, version, data = snapshot
        with self._lock:
            if epoch != self._epoch or version > self._version:
                self._epoch, self._version, self._data = epoch, version, data

    def _watch(self) -> None:
        while not self._stopped.is_set():
            try:
                watch = self._actor.watch.remote(self._epoch, self._version, WATCH_S)
                self._adopt(ray.get(watch))
            except SystemExit:  # Ray is shutting this process's worker down
                return
            except Exception:  # the actor restarting, or the cluster going: again
                if self._stopped.wait(1.0):
                    return
                logger.warning("watching the model registry failed; again in 1 s", exc_info=True)

    def close(self) -> None:
        self._stopped.set()


def _has_head_resource() -> bool:
    return any(
        "node:__internal_head__" in node["Resources"] for node in ray.nodes() if node["Alive"]
    )
