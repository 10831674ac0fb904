"""Where each stage runs, at run time: the stage groups that the config's `topology` makes
(decided once, in serve_app/config.py: `groups`, `deployment_name`), and the calls between them.

The three stages (preprocess, inference, postprocess) always run in that order; a topology
groups them into Serve deployments, each group one deployment whose replicas run their stages
one after the other in-process:

    chained  [preprocess] [inference] [postprocess]   three deployments, one per stage
    fused    [preprocess, inference, postprocess]     one deployment, one Ray call a batch
    direct   ()                                       no deployment: the ingress hosts all

or any grouping written out, e.g. `[[preprocess, inference], [postprocess]]`. A group is named
for its main stage (Inference if it holds inference), and that name is what the Serve
config's `deployments:` section configures. The ingress sends each micro-batch of requests
through the groups as a chain of handle calls (serve_app/ingress/deployment.py), or with
`stage_ports` over the replicas' own gRPC ports (serve_app/transport/stage_port.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import ray
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from engines.repository import ModelRef, ModelSpec, PreprocessSpec, resolve, select_versions
from serve_app import tuning
from serve_app.config import MESSAGE_LIMIT_ENV, AppConfig, Group
from serve_app.core.messages import Answer, Batch, Served
from serve_app.errors import Unavailable, clip
from serve_app.models.registry import ModelRegistry, key_of, split_key
from serve_app.observability import tracing
from serve_app.observability.metrics import StageCallMetrics, resident_memory_bytes
from serve_app.observability.tracing import StageTrace
from serve_app.stages.inference import InferenceStage
from serve_app.stages.postprocess import PostprocessStage
from serve_app.stages.preprocess import PreprocessStage, load_model
from serve_app.transport.stage_port import PortCalls
from serve_app.tuning import (
    BY_VALUE_MAX_BYTES,
    BY_VALUE_MIN_LIMIT,
    DEFAULT_PREPROCESS_THREADS,
    POLL_S,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


# Serve's gRPC transport between replicas (`_by_reference=False`): a call's argument and
# result travel in the call itself, not through Ray's object store and a streamed reply.
# Measured on one H200 (the shipped GPU config), against the object store for every
# call: one-image requests 1.16x the images/s, p50 at 5,000 img/s 35 against 46 ms; but
# calls of 10-20 MB (32 requests of 8 photos) 0.63-0.77x. So a batch goes by value only up to
# BY_VALUE_MAX_BYTES; a call's answers must fit the limit on messages,
# RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH (4 MiB unless set), on both ends: calls go by value
# only where it is raised to BY_VALUE_MIN_LIMIT. The shipped configs set 1 GiB in the
# application's runtime_env (every replica has it), and `raystream serve` sets it for any config
# that does not (serve_app/config.py, BY_VALUE_ENV).


def decode_threads() -> int:
    """The CPU decode threads of this replica's preprocess stage: the CPUs Ray gave it
    (ray_actor_options' num_cpus, rounded up), at least DEFAULT_PREPROCESS_THREADS, so that
    one thread stays free for cheap images while another decodes a heavy one (decode_pool.py)."""
    cpus = 0.0
    context = ray.get_runtime_context() if ray.is_initialized() else None
    if context is not None and context.worker.mode == ray.WORKER_MODE:  # not a driver (tests)
        cpus = context.get_assigned_resources().get("CPU", 0.0)
    return max(DEFAULT_PREPROCESS_THREADS, math.ceil(cpus))


def drain_timeout_s() -> float:
    """How long this stopping replica gives what it has read to be answered: from its
    deployment's graceful_shutdown_timeout_s (serve_app/tuning.py, drain_timeout_s)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:  # not in a replica (tests)
        return tuning.drain_timeout_s(None)
    config = getattr(context, "_deployment_config", None)  # not public: Serve may rename it
    return tuning.drain_timeout_s(getattr(config, "graceful_shutdown_timeout_s", None))


def message_limit() -> int:
    return int(os.environ.get(MESSAGE_LIMIT_ENV, 4 << 20))


class StageHandle:
    """Calls to one stage deployment with the batch in hand: by value when it is small and
    the message limit allows (above), else by reference."""

    def __init__(self, handle: DeploymentHandle) -> None:
        by_value = message_limit() >= BY_VALUE_MIN_LIMIT
        self._by_reference = handle
        self._by_value = handle.options(_by_reference=False) if by_value else None

    @property
    def transport(self) -> str:
        if self._by_value is None:
            return f"Ray's object store ({MESSAGE_LIMIT_ENV} under {BY_VALUE_MIN_LIMIT >> 20} MiB)"
        return f"by value over Serve's gRPC transport up to {BY_VALUE_MAX_BYTES >> 20} MiB a batch"

    def handle_for(self, batch: Batch) -> DeploymentHandle:
        if self._by_value is not None and batch.nbytes() <= BY_VALUE_MAX_BYTES:
            return self._by_value
        return self._by_reference

    def run(self, batch: Batch) -> DeploymentResponse:
        return self.handle_for(batch).run.remote(batch)


class StageChain:
    """The calls of one micro-batch through the stage deployments. Up to the group holding
    inference, the ingress makes them: each call takes the previous one's response as its
    argument, so Serve routes it once that result is ready and the replica fetches it
    straight from the one that made it (the images and crops, the large part, never pass
    back through the ingress); such a chain goes through Ray's object store. The group
    holding inference calls the groups after it itself and returns their answers: its
    results are small, Ray returns small results to the caller, and passed through the
    ingress between two calls they cost one connection, whose requests all share one
    ingress replica, 28% of its images/s (H200, docs/performance.md). A chain of one call
    (the group holding inference holds preprocess too) goes by value where it fits
    (StageHandle)."""

    def __init__(
        self,
        handles: list[DeploymentHandle],
        registry: ModelRegistry | None = None,
        token: str = "",
        node: str = "",
        shared_bytes: int = 0,
        node_id: str = "",
    ) -> None:
        """`registry`: with `stage_ports`, where the first group's replicas report
        their ports (`token`: the stage token); each group then calls the next itself
        (serve_app/app.py), so the ingress makes one call, over a port (stage_port.py),
        handing the images to replicas on its `node` in `shared_bytes` of shared memory,
        over their Unix sockets where they report its Ray `node_id`."""
        self._handles = handles  # the last one holds inference
        self._single = StageHandle(handles[0]) if len(handles) == 1 else None
        self._port = None
        if registry is not None:
            first = self._single or StageHandle(handles[0])
            self._port = PortCalls(
                registry,
                handles[0].deployment_name,
                first.run,
                token,
                node,
                shared_bytes,
                StageCallMetrics(),
                node_id=node_id,
            )

    async def run(self, batch: Batch) -> list[Answer]:
        if self._port is not None:
            return await self._port.run(batch)
        if self._single is not None:
            return await self._single.run(batch)
        response = batch
        for handle in self._handles:
            response = handle.run.remote(response)
        return await response

    @property
    def transport(self) -> str:
        if self._port is not None:
            return self._port.transport
        if self._single is None:
            return "Ray's object store (a chain of several calls)"
        return self._single.transport

    def stop(self) -> None:
        """The replica is stopping: stop following the ports' addresses (PortCalls.stop)."""
        if self._port is not None:
            self._port.stop()

    async def close(self) -> None:
        if self._port is not None:
            await self._port.close()

    async def info(self, key: str = "") -> Served:
        return await self._handles[-1].info.remote(key)


@dataclass
class ModelStages:
    """One model version's stages in a group (those of the group's stages)."""

    spec: ModelSpec
    preprocess: PreprocessStage | None
    inference: InferenceStage | None
    postprocess: PostprocessStage | None

    @classmethod
    async def create(
        cls,
        config: AppConfig,
        stages: Group,
        model: ModelRef,
        preprocess: Callable[[PreprocessSpec], Awaitable[PreprocessStage]],
    ) -> ModelStages:
        spec = model.spec
        decodes = config.decode == "gpu" and not config.experimental.preprocess_decodes_on_gpu
        return cls(
            spec,
            await preprocess(spec.preprocess) if "preprocess" in stages else None,
            await InferenceStage.create(config, model, decodes) if "inference" in stages else None,
            PostprocessStage(spec) if "postprocess" in stages else None,
        )

    async def run(self, batch: Batch, trace: StageTrace | None = None) -> Batch | list[Answer]:
        """`trace`: the batch's spans here, where any of its requests is traced."""
        if self.preprocess is not None:
            started, before = time.perf_counter(), batch
            batch = await self.preprocess.run(batch)
            if trace is not None:
                on_cpu = isinstance(batch.crops, np.ndarray | None) and not batch.jpegs
                trace.decoded(started, before, batch, "cpu" if on_cpu else "gpu")
        if self.inference is not None:
            started = time.perf_counter()
            batch = await self.inference.run(batch)
            if trace is not None:
                trace.inferred(started, batch)
        if self.postprocess is not None:
            return await self.postprocess.run(batch)
        return batch

    def info(self) -> Served:
        spec = self.spec
        label_bytes = max((len(label.encode()) for label in spec.labels), default=0)
        return Served(
            spec.name, spec.version, self.inference.info, spec.embedding_space, label_bytes
        )

    async def close(self) -> None:
        if self.inference is not None:
            await self.inference.close()


def initial_versions(config: AppConfig) -> list[str]:
    """The model versions served at start: each model's version policy over the repository."""
    return [
        key_of(entry.name, version)
        for entry in config.model_entries
        for version in select_versions(
            config.model_repository, entry.name, entry.latest, entry.versions
        )
    ]


class StageGroup:
    """The stages of one group, for every model version served: the code behind a group's
    deployment (serve_app/app.py), or behind the ingress in topology direct. Each batch
    carries one model version's requests (`Batch.model`; empty: the default model).

    With a registry (serve_app/models/registry.py), the group follows the application's desired
    state: it loads and warms new versions, then reports them held; it drops the versions
    no longer wanted."""

    @staticmethod
    def model_spec(config: AppConfig):
        return load_model(config).spec

    @classmethod
    async def create(
        cls,
        config: AppConfig,
        stages: Group,
        registry: ModelRegistry | None = None,
        deployment: str = "",
        replica: str = "",
        address: str = "",
        node: str = "",
        unix: str = "",
    ) -> StageGroup:
        """`address`: the replica's stage port, reported with its models (stage_port.py),
        with its Ray `node` id and the port's `unix` socket for callers on that node."""
        group = cls()
        group._config, group._stages = config, stages
        group._registry, group._deployment, group._replica = registry, deployment, replica
        group._address, group._node, group._unix = address, node, unix
        group.models: dict[str, ModelStages] = {}
        group._unloading: dict[str, ModelStages] = {}  # still watched while they close
        group.failed: dict[str, str] = {}
        group._stuck: str | None = None  # a load past LOAD_TIMEOUT_S (check_health)
        group._preprocess: dict[PreprocessSpec, PreprocessStage] = {}
        group._user_config: dict | None = None
        group._default = config.model
        tracing.configure(config.tracing, deployment or "Ingress")
        group._trace_attributes = {
            "raystream.deployment": deployment or "Ingress",
            "raystream.replica": replica,
            "raystream.node": address.rpartition(":")[0] or _node_address(),
            "raystream.pid": os.getpid(),
        }
        initial = initial_versions(config)
        wanted = initial if registry is None else list(registry.start(initial))
        await group._sync(wanted, at_start=True)
        if group._stuck is not None:  # Serve starts another replica in this one's place
            raise RuntimeError(group._stuck)
        group._follow_task = group._sync_task = None
        if registry is not None:
            await group._report()
            group._follow_task = asyncio.create_task(group._follow())
        return group

    # -- the models held ----------------------------------------------------------------------

    async def _sync(self, wanted: list[str], at_start: bool = False) -> None:
        """Load (and warm) the versions wanted and not held; drop those held and not wanted.
        A load stuck past LOAD_TIMEOUT_S ends the loading: this replica is to be
        replaced (check_health). At run time the version is no longer wanted either, as the
        ingress that asked for it decides at the same deadline (it may have gone): else
        every replica started in this one's place would load it and get stuck again."""
        for key in wanted:
            if self._stuck is not None:
                break
            if key in self.models or key in self.failed:
                continue
            name, version = split_key(key)
            limit = tuning.LOAD_TIMEOUT_S  # read here: tests lower it
            try:
                model = resolve(self._config.model_repository, name, version)
                loaded = await _within(
                    limit,
                    ModelStages.create(self._config, self._stages, model, self._preprocess_stage),
                )
            except Exception as exc:  # reported: the load that asked for it fails
                logger.exception("loading %s failed", key)
                self.failed[key] = f"{type(exc).__name__}: {exc}"
                continue
            if loaded is None:  # its thread goes on: only a new process is clean
                self._stuck = self.failed[key] = (
                    f"loading model {key} ran past its load timeout ({limit:g} s); it is stuck"
                )
                logger.error(self._stuck)
                if not at_start and self._registry is not None:
                    await asyncio.to_thread(self._registry.remove, [key], "serve")
                continue
            self.models[key] = loaded
            if self._user_config is not None and self.models[key].inference is not None:
                self.models[key].inference.reconfigure(self._user_config)
            logger.info("model %s loaded", key)
        for key in [key for key in self.models if key not in wanted]:
            self._unloading[key] = self.models.pop(key)
            try:
                await self._unloading[key].close()  # waits for the batches its engine runs
            finally:
                del self._unloading[key]
            await asyncio.to_thread(return_freed_memory)
            logger.info("model %s unloaded", key)
        if self._stuck is None:  # a stuck replica reports its failures until it is replaced
            for key in [key for key in self.failed if key not in wanted]:
                del self.failed[key]  # asked again later: tried again

    async def _report(self) -> None:
        """What this replica holds and failed to load, as of now (read on the event loop,
        which loads change), written to the registry from a thread."""
        holds, failed = list(self.models), dict(self.failed)
        await asyncio.to_thread(
            self._registry.report,
            self._deployment,
            self._replica,
            holds,
            failed,
            self._address,
            self._node,
            self._unix,
        )

    def check_health(self) -> None:
        """Raises where an engine or nvJPEG call has run past ENGINE_STALL_TIMEOUT_S:
        it is stuck (a hung GPU or runtime), and Serve replaces a replica whose health check
        fails; the calls it held are sent again elsewhere (serve_app/core/serving.py). Raises too
        once a model version's load has run past LOAD_TIMEOUT_S."""
        if self._stuck is not None:
            logger.error(self._stuck)
            raise RuntimeError(self._stuck)
        limit = tuning.ENGINE_STALL_TIMEOUT_S  # read here: tests lower it
        held = {**self.models, **self._unloading}
        stages = [(f"model {key}", s.inference) for key, s in held.items() if s.inference]
        stages += [("preprocess", stage) for stage in self._preprocess.values()]
        for name, stage in stages:
            if (ran := stage.stalled_s()) > limit:
                message = (
                    f"{name}: a GPU or engine call has run for {ran:.0f} s, past "
                    f"the stall timeout ({limit:g} s); it is stuck"
                )
                logger.error(message)
                raise RuntimeError(message)

    def stop(self) -> None:
        """Stop following the registry (tests; a replica follows until it stops)."""
        for task in (self._follow_task, self._sync_task):
            if task is not None:
                task.cancel()

    async def leave(self) -> None:
        """The replica is stopping: its report leaves the registry now."""
        self.stop()
        if self._registry is not None:
            await asyncio.to_thread(self._registry.leave, self._deployment, self._replica)

    async def _follow(self) -> None:
        """Every POLL_S: report what this replica holds, and start syncing with the desired
        state unless a sync (a version loading: seconds, minutes on a GPU) still runs. The
        reports go on meanwhile, or the replica would read as gone (FRESH_S) while it loads:
        loads would route past it and callers drop its port."""
        while True:
            try:
                if self._sync_task is None or self._sync_task.done():
                    if self._sync_task is not None:
                        self._sync_task.result()  # a failed sync: logged below
                    desired = await asyncio.to_thread(self._registry.desired)
                    self._sync_task = asyncio.create_task(self._sync(list(desired)))
                    await asyncio.sleep(0)  # a sync with nothing to load ends at once
                await self._report()
            except Exception:  # a bug or a GCS hiccup must not stop following for good
                self._sync_task = None
                logger.exception("following the model registry failed")
            await asyncio.sleep(POLL_S)

    @property
    def stages(self) -> Group:
        return self._stages

    async def _preprocess_stage(self, spec: PreprocessSpec) -> PreprocessStage:
        """Versions that preprocess alike share one stage (its decode threads stay)."""
        if spec not in self._preprocess:
            decodes = self._config.experimental.preprocess_decodes_on_gpu
            stage = PreprocessStage(self._config, spec, decodes, decode_threads())
            try:
                await stage.warm()
            except BaseException:  # failed, or given up (stuck): a later load makes another
                stage.abandon()
                raise
            self._preprocess[spec] = stage
        return self._preprocess[spec]

    def model(self, key: str) -> ModelStages:
        """The stages of `key` ("name/version"; empty: the default model's latest held)."""
        if key in self.models:
            return self.models[key]
        if not key:
            held = [k for k in self.models if split_key(k)[0] == self._default]
            if held:
                return self.models[held[-1]]
        # The ingress routed it here, so the version was loaded: it went (an unload whose
        # drain timeout passed) or has not come yet (a replica that just started). Retryable.
        raise Unavailable(
            f"model version {clip(key)!r} is not loaded in this replica (unloaded while the "
            f"request was in flight, or not loaded here yet)"
        )

    async def run(self, batch: Batch, transport: str = "") -> Batch | list[Answer]:
        """`transport`: how the batch came (port or handle; its traces say so)."""
        attributes = {**self._trace_attributes, "raystream.transport": transport}
        trace = tracing.start_stage(batch, attributes)
        if trace is None:
            return await self.model(batch.model).run(batch)
        try:
            result = await self.model(batch.model).run(batch, trace)
        except BaseException as exc:
            trace.end(exc)
            raise
        trace.end()
        return result if isinstance(result, list) else trace.passed_on(result)

    def info(self, key: str = "") -> Served:
        """What is served: only the group that holds inference knows its engine."""
        if "inference" not in self._stages:
            raise ValueError("only the group that holds inference knows what is served")
        return self.model(key).info()

    def infos(self) -> list[Served]:
        return [stages.info() for stages in self.models.values()]

    def reconfigure(self, user_config: dict) -> None:
        if "inference" not in self._stages:
            raise ValueError("only the group that holds inference takes a batching user_config")
        self._user_config = user_config
        for stages in self.models.values():
            stages.inference.reconfigure(user_config)

    def batching(self) -> dict:
        return self.model("").inference.batching()

    def images_inferred(self) -> int:
        return sum(stages.inference.images_inferred for stages in self.models.values())

    @staticmethod
    def memory_bytes() -> int:
        return resident_memory_bytes()

    @staticmethod
    def pid() -> int:
        return os.getpid()


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else ""


def return_freed_memory() -> None:
    """Frees what an unloaded version left in reference cycles (cancelled tasks keep their
    frames), then hands the heap's free pages back to the system (glibc's malloc_trim;
    elsewhere nothing): a closed engine's buffers were freed by the threads that used them,
    into their own malloc arenas, which glibc does not shrink by itself. Without both, each
    unload/load cycle kept about 530 MB in an Inference replica (ONNX Runtime, 2-core CPU)."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (musl and others have none)
    except (OSError, AttributeError):
        return None
    return libc


_libc = _glibc()


async def _within(limit_s: float, work: Coroutine[object, object, T]) -> T | None:
    """`work`'s result, or None once `limit_s` has passed. Then `work` is cancelled but not
    awaited: a load stuck in a thread (a hung GPU) would hold up its own cancellation."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=limit_s)
    finally:
        if not task.done():
            task.cancel()
    return task.result() if done else None
