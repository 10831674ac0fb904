"""Loading and unloading model versions at run time, from an ingress replica, with no
downtime (serve_app/models/registry.py holds the shared state; docs/operations.md the procedure).

Load: the versions wanted are marked `serve`; every stage replica loads and warms them and
reports them held; each ingress routes to a version only once every live replica of every
stage deployment holds it. Then the model's versions outside the new set are unloaded.
Unload: the version is marked `drain`, so ingresses stop routing new requests to it
(NOT_FOUND) while those in flight finish; once no ingress reports any in flight, it is
removed and the stage replicas drop it. A request that named a version is never answered
by another one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from engines.repository import (
    LOAD_FAILED,
    is_entry_name,
    list_models,
    list_versions,
    select_versions,
)
from serve_app.config import ModelEntry
from serve_app.core.messages import Served
from serve_app.core.serving import ServingCore
from serve_app.errors import (
    MAX_MESSAGE_CHARS,
    DeadlineExceeded,
    InvalidArgument,
    ModelNotFound,
    Unavailable,
    clip,
)
from serve_app.models.registry import ModelRegistry, key_of, parse_model_name, split_key
from serve_app.tuning import POLL_S

logger = logging.getLogger(__name__)

ROUTES = "ingress-routes"  # the deployment name under which ingresses report their routes
# An ingress waits this much past LOAD_TIMEOUT_S for a load: a stage replica's own
# timeout (its load starts up to POLL_S after the ask, its report comes within POLL_S)
# fires first, so the caller hears which version is stuck rather than a bare deadline.
REPORT_MARGIN_S = 4 * POLL_S
T = TypeVar("T")


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str  # READY, LOADING, UNLOADING, UNAVAILABLE
    reason: str = ""


class ModelLifecycle:
    def __init__(
        self,
        core: ServingCore,
        registry: ModelRegistry,
        stage_deployments: Iterable[str],
        replica: str,
        info: Callable[[str], Awaitable[Served]],
        repository: Path,
        policies: Iterable[ModelEntry] = (),
        drain_timeout_s: float = 10.0,
        load_timeout_s: float = 600.0,
    ) -> None:
        """`info(key)`: what a stage replica that holds the version reports of it."""
        self._core, self._registry = core, registry
        self._stages = tuple(stage_deployments)
        self._replica, self._info = replica, info
        self._repository = repository
        self._policies = {entry.name: entry for entry in policies}
        self._drain_timeout_s = drain_timeout_s
        self._load_timeout_s = load_timeout_s
        # one load or unload of a model at a time in this ingress; other models' go on
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )
        self._task: asyncio.Task | None = None
        self._work: set[asyncio.Task] = set()  # loads and unloads (their callers may leave)
        # one poll at a time: an unload's own poll waits for one that read the registry
        # before it, or that one would route to the version once it is unloaded
        self._polling = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    def stop(self) -> None:
        for task in (self._task, *self._work):
            if task is not None:
                task.cancel()

    async def leave(self) -> None:
        """The ingress replica is stopping: its routes' report leaves the registry now."""
        self.stop()
        await asyncio.to_thread(self._registry.leave, ROUTES, self._replica)

    # -- following the desired state --------------------------------------------------------

    async def follow_once(self) -> None:
        """Route to the versions held everywhere and wanted; stop routing the others;
        report what this ingress routes or still has in flight."""
        async with self._polling:
            await self._follow_once()

    async def _follow_once(self) -> None:
        registry, core = self._registry, self._core
        desired = await asyncio.to_thread(registry.desired)
        missing = [k for k, state in desired.items() if state == "serve" and k not in core.models]
        if missing:
            held = await asyncio.to_thread(registry.held_everywhere, self._stages)
            for key in missing:
                if key in held:
                    core.add(await self._info(key))
                    logger.info("routing to %s", key)
        for key in [key for key in core.models if desired.get(key) != "serve"]:
            core.retire(key)
            logger.info("stopped routing to %s", key)
        busy = set(core.models) | set(core.in_flight_by_model)
        await asyncio.to_thread(registry.report, ROUTES, self._replica, busy)

    async def _follow(self) -> None:
        while True:
            try:
                await self.follow_once()
            except Exception:  # a bug or a GCS hiccup must not stop following for good
                logger.exception("following the model registry failed")
            await asyncio.sleep(POLL_S)

    # -- load and unload ----------------------------------------------------------------------

    def versions_for(
        self, name: str, latest: int | None = None, versions: tuple[str, ...] = ()
    ) -> list[str]:
        """A version policy over the repository; none given: the model's from the config
        (else its latest version)."""
        if latest is None and not versions and name in self._policies:
            latest, versions = self._policies[name].latest, self._policies[name].versions
        # a client's names: no entry of the repository can be longer (its messages echo them)
        if not is_entry_name(name):
            raise ModelNotFound(f"model {clip(name)!r} is not in the model repository")
        for version in versions:
            if not is_entry_name(version):
                raise ModelNotFound(f"model {clip(name)!r} has no version {clip(version)!r}")
        try:
            return select_versions(self._repository, name, latest, versions)
        except LookupError as exc:  # lists the versions missing: as many as the client sent
            raise ModelNotFound(clip(str(exc), MAX_MESSAGE_CHARS)) from None
        except ValueError as exc:  # a policy no version fits: latest < 1
            raise InvalidArgument(str(exc)) from None

    async def load(
        self,
        name: str,
        latest: int | None = None,
        versions: tuple[str, ...] = (),
        beside: bool = False,
    ) -> list[str]:
        """Serve the versions of `name` its policy picks, warmed everywhere before they take
        traffic; then unload its other versions, unless `beside` (they stay). Returns the
        versions loaded."""
        wanted = self.versions_for(name, latest, versions)
        keys = [key_of(name, v) for v in wanted]
        await self._to_the_end(self._load(name, keys, unload_others=not beside))
        return wanted

    async def _load(self, name: str, keys: list[str], unload_others: bool) -> None:
        async with self._locks[name]:
            await asyncio.to_thread(self._registry.set_state, keys, "serve")
            await self._until_routed(keys)
            if unload_others:
                desired = await asyncio.to_thread(self._registry.desired)
                await self._unload(
                    [k for k in desired if split_key(k)[0] == name and k not in keys]
                )

    async def unload(self, name: str, version: str = "") -> list[str]:
        """Stop serving `name` (every version, or `version`), without failing a request in
        flight. Returns the versions unloaded."""
        if not version:
            name, version = parse_model_name(name)
        return await self._to_the_end(self._unload_model(name, version))

    async def _unload_model(self, name: str, version: str) -> list[str]:
        await self._loaded_keys(name, version)  # first: no lock for a name a client made up
        async with self._locks[name]:
            keys = await self._loaded_keys(name, version)
            await self._unload(keys)
        return [split_key(key)[1] for key in keys]

    async def _loaded_keys(self, name: str, version: str) -> list[str]:
        """The versions of `name` being served or drained (`version`: that one only)."""
        desired = await asyncio.to_thread(self._registry.desired)
        keys = [
            key
            for key in desired
            if split_key(key)[0] == name and version in ("", split_key(key)[1])
        ]
        if not keys:
            asked = f"{clip(name)!r}" + (f" version {clip(version)!r}" if version else "")
            raise ModelNotFound(f"model {asked} is not loaded")
        return keys

    async def _to_the_end(self, work: Coroutine[object, object, T]) -> T:
        """Runs `work` to its end even if the caller leaves first (a client's deadline or
        cancel): a load cut short would serve the new versions beside the old ones."""
        task = asyncio.create_task(work)
        self._work.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task) -> None:
        self._work.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved: no warning
            logger.info("model load or unload ended: %s", task.exception())

    async def _until_routed(self, keys: list[str]) -> None:
        """Waits until this ingress routes every key. A load that fails on some replica, or
        is not ready everywhere in `load_timeout_s`, is withdrawn (its keys not routed yet are
        no longer wanted), so it never serves later beside the versions it was to replace."""
        deadline = time.monotonic() + self._load_timeout_s + REPORT_MARGIN_S
        while not all(key in self._core.models for key in keys):
            failed = await asyncio.to_thread(self._registry.failures, self._stages)
            errors = {key: failed[key] for key in keys if key in failed}
            late = time.monotonic() > deadline
            if errors or late:
                unready = [key for key in keys if key not in self._core.models]
                await asyncio.to_thread(self._registry.remove, unready, "serve")
                if errors:
                    raise Unavailable(f"{LOAD_FAILED}: {errors}")
                raise DeadlineExceeded(
                    f"{keys} not ready on every replica in the load timeout "
                    f"({self._load_timeout_s:g} s)"
                )
            await asyncio.sleep(POLL_S)

    async def _unload(self, keys: list[str]) -> None:
        """Drain `keys` (no new requests; those in flight finish), then remove them."""
        if not keys:
            return
        await asyncio.to_thread(self._registry.set_state, keys, "drain")
        deadline = time.monotonic() + self._drain_timeout_s + 2 * POLL_S
        try:  # whatever happens meanwhile, the versions go: none stays draining for good
            while True:
                try:
                    await self.follow_once()  # this ingress stops routing them at once
                    await asyncio.sleep(POLL_S)
                    busy = await asyncio.to_thread(self._registry.held_anywhere, ROUTES)
                except Exception:  # a GCS hiccup: look again until the deadline
                    logger.exception("following the drain of %s failed", keys)
                    await asyncio.sleep(POLL_S)
                    busy = set(keys)
                if not busy.intersection(keys):
                    break
                if time.monotonic() > deadline:
                    logger.warning("unloading %s with requests still in flight", keys)
                    break
        finally:
            await asyncio.to_thread(self._registry.remove, keys, "drain")
        await self._until_dropped(keys)
        logger.info("unloaded %s", keys)

    async def _until_dropped(self, keys: list[str]) -> None:
        """Waits until no stage replica holds `keys`: an unload answered before then, and a
        load of the version sent at once, found it still held and served it from the files
        it was loaded from (their change unread), with its engine's memory never returned."""
        deadline = time.monotonic() + self._drain_timeout_s + 4 * POLL_S
        while True:
            held = set()
            for deployment in self._stages:
                held |= await asyncio.to_thread(self._registry.held_anywhere, deployment)
            if not held.intersection(keys):
                return
            if time.monotonic() > deadline:
                logger.warning("%s still held by stage replicas after their unload", keys)
                return
            await asyncio.sleep(POLL_S)

    # -- the repository index -------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every version in the repository and whether it serves (Triton's states)."""
        desired = self._registry.desired()
        entries = []
        for name in list_models(self._repository):
            for version in list_versions(self._repository, name):
                key = key_of(name, version)
                if key in self._core.models:
                    entry = IndexEntry(name, version, "READY")
                elif desired.get(key) == "serve":
                    entry = IndexEntry(name, version, "LOADING")
                elif desired.get(key) == "drain":
                    entry = IndexEntry(name, version, "UNLOADING")
                else:
                    entry = IndexEntry(name, version, "UNAVAILABLE", "unloaded")
                if entry.state == "READY" or not ready_only:
                    entries.append(entry)
        return entries
