"""The inference stage: one engine, the dynamic batcher in front of it, and (decode: gpu) the
nvJPEG decoder beside it. Plain code: the Inference deployment hosts it, or the ingress
replica itself in topology `direct` (serve_app/pipeline/topology.py).

A call brings a whole Batch (many requests); its images are cut into pieces of at most
`max_batch_size` that join the batcher's queue, so one engine batch can hold images of several
calls (and streams, and ingress replicas). One engine pass gives every image's logits and
embedding; the results come back as arrays for the whole call, not per request: top-k for
the rows of jobs that asked for labels, embeddings where a job asked for them. Work here is
per batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np

from engines import Engine, EngineInfo, Outputs, create_engine, pick_engine
from engines import scores as postprocessing
from engines.repository import ModelRef
from serve_app.config import AppConfig, BatchingConfig
from serve_app.core.messages import NO_OWNERS, Batch, Failure, Job, StageTiming, fail_jobs
from serve_app.errors import Code, Unavailable
from serve_app.observability import tracing
from serve_app.observability.metrics import InferenceMetrics
from serve_app.stages.batching import DynamicBatcher
from serve_app.stages.nvjpeg_queue import NvjpegQueue
from serve_app.stages.stall_watch import StallWatch
from serve_app.tuning import DECODE_BATCH, MAX_CONCURRENT_BATCHES

logger = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass(frozen=True)
class _Scored:
    """One group's outputs (a part per piece, rows in `owners`' order) and where its time
    went (ms)."""

    owners: np.ndarray
    parts: list[Outputs]
    queue_ms: float
    inference_ms: float
    batch_size: int
    decode_ms: float = 0.0
    gpu_ms: float = 0.0


@dataclass(frozen=True)
class _Ran:
    outputs: Outputs
    started: float  # perf_counter() when its engine batch started
    inference_ms: float
    batch_size: int
    gpu_ms: float = 0.0  # the engine batch's GPU time, where it was timed (Outputs.gpu_ms)


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def engine_options(config: AppConfig) -> dict:
    """The engine's options from the config, and for ONNX Runtime its threads per batch: the
    host's cores shared by the MAX_CONCURRENT_BATCHES batches it runs at once, unless the
    config says. On 2 cores, two batches of one thread each served 1.02-1.24x the images/s
    of one batch on both cores (the chained CPU default, 4 interleaved pairs of runs, with
    17.9-19.8 against 18.8-22.7 CPU ms an image): threads of one batch wait for each other
    at every operator, two batches do not."""
    options = dict(config.engine.options)
    if pick_engine(config.engine.kind) == "onnxruntime":
        options.setdefault("threads", max(1, (os.cpu_count() or 1) // MAX_CONCURRENT_BATCHES))
    return options


def _warm_engine(config: AppConfig, model: ModelRef) -> Engine:
    engine = create_engine(
        config.engine.kind,
        model,
        max_batch_size=config.engine.batch_capacity,
        precision=config.engine.precision,
        **engine_options(config),
    )
    engine.warmup()
    return engine


def _process_age_s() -> float:
    """Seconds since this process started (Linux: /proc), NaN elsewhere: where a replica's
    start goes, beside the engine's own time."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def _kind(pixels) -> str:
    """Which batcher rows join: uint8 crops on the host, float32 client tensors, or crops
    already on the GPU (a torch tensor): they batch apart."""
    if isinstance(pixels, np.ndarray):
        return "float32" if pixels.dtype == np.float32 else "uint8"
    return "device"


class InferenceStage:
    """Owns one engine; `run(batch)` scores every image of every live job in the batch.
    `decodes`: the JPEGs the preprocess stage left encoded are decoded here (decode: gpu,
    unless the Preprocess replicas decode them: experimental.preprocess_decodes_on_gpu)."""

    @classmethod
    async def create(
        cls, config: AppConfig, model: ModelRef, decodes: bool = False
    ) -> InferenceStage:
        stage = cls.__new__(cls)
        await stage._start(config, model, decodes)
        return stage

    async def _start(self, config: AppConfig, model: ModelRef, decodes: bool) -> None:
        self._spec = model.spec
        self._mean = model.spec.preprocess.mean_array
        self._std = model.spec.preprocess.std_array
        # its decode waits for kernels: asleep, not spinning
        if config.experimental.gpu_hybrid_decode:
            import torch

            from engines.cuda_graphs import sleep_in_every_gpu_wait

            sleep_in_every_gpu_wait(torch.device("cuda"))
        # Off the event loop: building and warming a GPU engine can take a minute.
        began = time.perf_counter()
        self._engine = await asyncio.to_thread(_warm_engine, config, model)
        engine_s = time.perf_counter() - began
        self._engine.time_gpu = tracing.enabled()  # the engine spans' raystream.gpu_ms
        cpu = self._engine.info.device == "cpu"
        self._executor = ThreadPoolExecutor(MAX_CONCURRENT_BATCHES, thread_name_prefix="engine")
        # crops decoded on the GPU (here, or in a Preprocess replica) stay there for the engine
        self._crops_on_device = not cpu
        self._nvjpeg = NvjpegQueue(config, model.spec.preprocess) if decodes else None
        if self._nvjpeg is not None:
            try:
                await self._warm_decoder()
            except BaseException:  # failed, or given up: nothing waits for a stuck thread
                self._nvjpeg.abandon()
                self._executor.shutdown(wait=False)
                raise
        self._closed = False  # unloaded (close)
        self._watch = StallWatch()  # the engine calls running (ENGINE_STALL_TIMEOUT_S)
        self._batching = BatchingConfig()
        self._refused: str | None = None  # the last user_config refused, and why
        self._metrics = InferenceMetrics()
        self.images_inferred = 0
        self._batchers = {
            kind: DynamicBatcher(
                self._run_engine,
                len,
                max_batch_size=self._batching.max_batch_size,
                max_concurrent=MAX_CONCURRENT_BATCHES,
                max_queued=self._batching.max_queued_images,
            )
            for kind in ("uint8", "float32", "device")
        }
        self.reconfigure(BatchingConfig().model_dump())
        logger.info(
            "engine ready %.1f s after the process started (the engine's own %.1f s): %s",
            _process_age_s(),
            engine_s,
            self._engine.info,
        )

    async def close(self) -> None:
        """Release the engine (unload) once the batches already on its threads are done:
        the batchers' workers stop (what they held fails UNAVAILABLE), and with decode: gpu
        the decode thread. A batch stuck in the engine holds the close, and the health
        check sees it (StageGroup.check_health)."""
        self._closed = True  # a batch formed meanwhile fails too
        closing = [batcher.close() for batcher in self._batchers.values()]
        if self._nvjpeg is not None:
            closing.append(self._nvjpeg.close())
        await asyncio.gather(*closing)
        # shielded: a replica stopping mid-unload (its sync task cancelled) still closes it
        await asyncio.shield(asyncio.to_thread(self._release))

    def _release(self) -> None:
        self._executor.shutdown()  # waits for the batches running
        self._engine.close()

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    # -- batching settings (the deployment's user_config) ----------------------------------

    def reconfigure(self, user_config: dict) -> None:
        """Apply a new batching user_config; one this replica cannot apply is logged and
        ignored, and the settings in force stay. (Raising would make Serve replace the
        replica, and every replacement would fail the same way: no replica would serve.)"""
        try:
            batching = BatchingConfig.model_validate(user_config)
            if batching.max_batch_size > self._engine.info.max_batch_size:
                raise ValueError(
                    f"max_batch_size must be at most the engine's "
                    f"{self._engine.info.max_batch_size}, got {batching.max_batch_size}"
                )
        except ValueError as exc:
            self._refused = f"{user_config}: {exc}"
            logger.error("user_config refused, keeping %s: %s", self._batching, self._refused)
            return
        self._refused = None
        self._batching = batching
        for batcher in self._batchers.values():
            batcher.max_batch_size = batching.max_batch_size
            batcher.max_delay_s = batching.batch_wait_timeout_s
            batcher.max_queued = batching.max_queued_images
            batcher.set_concurrency(self._engine.batches_at_once)
        logger.info("batching: %s", batching)

    def batching(self) -> dict:
        """The settings in force and the last user_config refused."""
        return {**self._batching.model_dump(), "refused": self._refused}

    # -- one call -----------------------------------------------------------------------------

    async def run(self, batch: Batch) -> Batch:
        now = time.time()
        failures = dict(batch.job_failures)
        for index, job in enumerate(batch.jobs):
            if index not in failures and job.deadline is not None and now >= job.deadline:
                failures[index] = Failure(
                    int(Code.DEADLINE_EXCEEDED), "deadline passed before inference"
                )
        batch = batch.replace(job_failures=failures)
        # Each group is scored as soon as its pixels are there: with decode: gpu, a piece of
        # JPEGs joins the engine's queue when nvJPEG is done with it, while the next piece
        # decodes. Groups record refused jobs in `failures`, decode errors in `bad_images`.
        bad_images = dict(batch.image_failures)
        groups = [self._score_group(p, o, batch, failures) for p, o in self._rows(batch)]
        groups += [
            self._decode_and_score(batch, lo, failures, bad_images)
            for lo in range(0, len(batch.jpegs), DECODE_BATCH)
        ]
        scored = [g for g in await asyncio.gather(*groups) if g is not None]
        # the inputs go here: crops on the GPU may be another process' memory (CUDA IPC)
        batch = batch.replace(
            job_failures=failures,
            image_failures=bad_images,
            crops=None,
            crop_owners=NO_OWNERS,
            jpegs=(),
            jpeg_owners=NO_OWNERS,
        )
        if not scored:
            return batch.replace(owners=NO_OWNERS)
        owners = np.concatenate([g.owners for g in scored])
        keep = _live(owners, failures)
        if not keep.any():
            return batch.replace(owners=NO_OWNERS)
        live = [batch.jobs[j] for j in set(owners[keep, 0].tolist())]
        # one copy of the rows for the whole call, and of embeddings only where asked for
        embedding = any(job.embedding for job in live)
        outputs = Outputs.concat([p for g in scored for p in g.parts], embedding=embedding)
        finite = np.isfinite(outputs.logits).all(axis=1) & np.isfinite(outputs.embedding).all(1)
        if not finite.all():
            bad_images.update(_not_finite(owners[keep & ~finite], batch.jobs))
            batch = batch.replace(image_failures=bad_images)
            keep &= finite
            if not keep.any():
                return batch.replace(owners=NO_OWNERS)
        if not keep.all():
            owners, outputs = owners[keep], outputs.take(keep)
        top_ids, top_scores = _top_k(outputs.logits, owners, batch.jobs)
        timing = StageTiming(
            preprocess_ms=batch.timing.preprocess_ms + max(g.decode_ms for g in scored),
            queue_ms=max(g.queue_ms for g in scored),
            inference_ms=max(g.inference_ms for g in scored),
            batch_size=max(g.batch_size for g in scored),
            gpu_ms=max(g.gpu_ms for g in scored),
        )
        return batch.replace(
            jobs=tuple(job.without_inputs() for job in batch.jobs),
            owners=owners,
            top_ids=top_ids,
            top_scores=top_scores,
            probabilities=(
                postprocessing.softmax(outputs.logits) if any(j.scores for j in live) else None
            ),
            embeddings=outputs.embedding if embedding else None,
            timing=timing,
        )

    async def _score_group(
        self, pixels, owners: np.ndarray, batch: Batch, failures: dict[int, Failure]
    ) -> _Scored | None:
        """One group's outputs, or None when none of its jobs got in: the queue was full,
        or the group failed as a whole (a deadline passed while queued); `failures` says
        which jobs, and why."""
        pixels, owners = self._admit(pixels, owners, failures)
        if not len(owners):
            return None
        queued = time.perf_counter()
        try:
            ran = await self._score(pixels, batch, owners)
        except Exception as exc:
            fail_jobs(failures, owners, exc)
            return None
        return _Scored(
            owners,
            [r.outputs for r in ran],
            queue_ms=max((r.started - queued) * 1000.0 for r in ran),
            inference_ms=max(r.inference_ms for r in ran),
            batch_size=max(r.batch_size for r in ran),
            gpu_ms=max(r.gpu_ms for r in ran),
        )

    def _admit(
        self, pixels, owners: np.ndarray, failures: dict[int, Failure]
    ) -> tuple[object, np.ndarray]:
        """The rows of the jobs the batch queue has room for, whole jobs in order, each
        taken if it fits in the room the ones before it left; the others fail at once with
        RESOURCE_EXHAUSTED (and never wait for the engine)."""
        batcher = self._batchers[_kind(pixels)]
        room = batcher.room()
        if len(owners) <= room:
            return pixels, owners
        refused = Failure(
            int(Code.RESOURCE_EXHAUSTED),
            f"inference queue is full ({batcher.queued_images} images waiting, limit "
            f"{batcher.max_queued}); retry later",
        )
        jobs, counts = np.unique(owners[:, 0], return_counts=True)
        admitted = set()
        for job, count in zip(jobs.tolist(), counts.tolist(), strict=True):
            if count <= room:
                admitted.add(job)
                room -= count
            else:
                failures[job] = refused
        rows = np.flatnonzero(np.isin(owners[:, 0], list(admitted)))
        return _take_rows(pixels, rows), owners[rows]

    def _rows(self, batch: Batch) -> list[tuple[object, np.ndarray]]:
        """The live images to score, as (pixels, owners) groups: the decoded crops, and the
        client tensors of every job that sent one (a group: scored as one, not per job)."""
        groups = []
        failures = batch.job_failures
        if batch.crops is not None and len(batch.crop_owners):
            crops = self._engine_input(batch.crops)
            pixels, owners = _live_rows(crops, batch.crop_owners, failures)
            if len(owners):
                groups.append((pixels, owners))
        tensors = [
            (index, job.pixels)
            for index, job in enumerate(batch.jobs)
            if job.pixels is not None and index not in failures
        ]
        if tensors:
            counts = [len(pixels) for _, pixels in tensors]
            job_of = np.repeat([index for index, _ in tensors], counts)
            image_of = np.concatenate([np.arange(count) for count in counts])
            owners = np.stack([job_of, image_of], axis=1).astype(np.int32)
            pixels = tensors[0][1] if len(tensors) == 1 else np.concatenate([p for _, p in tensors])
            groups.append((pixels, owners))
        return groups

    async def _score(self, pixels, batch: Batch, owners: np.ndarray) -> list[_Ran]:
        """`pixels` run, in pieces that batch independently. A piece still queued once the
        deadlines of all the group's jobs passed is dropped (nobody waits for it); one job's
        short deadline never drops the others' images."""
        deadlines = [batch.jobs[j].deadline for j in set(owners[:, 0].tolist())]
        deadline = None if None in deadlines else max(deadlines)
        return await _in_pieces(
            lambda piece: self._submit(piece, deadline), pixels, self._batching.max_batch_size
        )

    async def _submit(self, pixels, deadline: float | None) -> _Ran:
        ran, _ = await self._batchers[_kind(pixels)].submit(pixels, deadline)
        return ran

    async def _run_engine(self, pieces: list) -> list[_Ran]:
        """One engine batch from several pieces; its outputs split back per piece."""
        if self._closed:
            raise Unavailable("the model version was unloaded before this request's batch ran")
        start = time.perf_counter()
        kind = _kind(pieces[0])
        if len(pieces) == 1:
            pixels = pieces[0]
        elif kind == "device":
            import torch  # only replicas with decode: gpu get here

            pixels = torch.cat(pieces)  # on this thread's stream, which engines wait for
        else:
            pixels = np.concatenate(pieces)
        loop = asyncio.get_running_loop()
        if kind == "float32":
            outputs = await loop.run_in_executor(
                self._executor, self._watch.run, self._engine.infer, pixels
            )
        else:
            outputs = await loop.run_in_executor(
                self._executor,
                self._watch.run,
                self._engine.infer_uint8,
                pixels,
                self._mean,
                self._std,
            )
        inference_ms = ms_since(start)
        self.images_inferred += len(pixels)
        self._metrics.record_batch(len(pixels))
        bounds = itertools.accumulate((len(piece) for piece in pieces), initial=0)
        return [
            _Ran(outputs.rows(lo, hi), start, inference_ms, len(pixels), outputs.gpu_ms)
            for lo, hi in itertools.pairwise(bounds)
        ]

    def stalled_s(self) -> float:
        """How long the oldest engine or nvJPEG call still running has run; 0 if none runs."""
        decoding = self._nvjpeg.stalled_s() if self._nvjpeg is not None else 0.0
        return max(self._watch.stalled_s(), decoding)

    # -- decode: gpu --------------------------------------------------------------------------

    async def _decode_and_score(
        self,
        batch: Batch,
        lo: int,
        failures: dict[int, Failure],
        bad_images: dict[tuple[int, int], Failure],
    ) -> _Scored | None:
        """The batch's JPEGs from `lo` (at most DECODE_BATCH) through nvJPEG, in the decode
        batcher with other calls' pieces, then scored; an image nvJPEG refuses fails alone."""
        start = time.perf_counter()
        jpegs = batch.jpegs[lo : lo + DECODE_BATCH]
        owners = batch.jpeg_owners[lo : lo + DECODE_BATCH]
        try:
            decoded = await self._nvjpeg.decode(list(jpegs))
        except Exception as exc:  # the decoder itself failed: every job of the piece fails
            fail_jobs(failures, owners, exc)
            return None
        decode_ms = ms_since(start)
        for i, error in decoded.errors:
            job, image = owners[i].tolist()
            bad_images[job, image] = Failure(int(error.code), str(error))
        owners = owners[list(decoded.good)]
        pixels, owners = _live_rows(self._engine_input(decoded.pixels), owners, failures)
        scored = await self._score_group(pixels, owners, batch, failures) if len(owners) else None
        return None if scored is None else replace(scored, decode_ms=decode_ms)

    def _engine_input(self, crops):
        """Crops as the engine takes them: a tensor on the GPU stays there for a GPU engine;
        any other tensor (a CPU engine, a stand-in decoder in tests) becomes a host array."""
        if isinstance(crops, np.ndarray) or (self._crops_on_device and crops.is_cuda):
            return crops
        return crops.cpu().numpy()

    async def _warm_decoder(self) -> None:
        """The decode thread decodes once, then the engine runs those crops, before the
        replica reports ready (nvJPEG's first call and the resize kernels' loading cost
        seconds)."""
        loop = asyncio.get_running_loop()
        crops = self._engine_input((await self._nvjpeg.warm()).pixels)
        await loop.run_in_executor(
            self._executor, self._engine.infer_uint8, crops, self._mean, self._std
        )


def _top_k(
    logits: np.ndarray, owners: np.ndarray, jobs: tuple[Job, ...]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Top-k ids and probabilities, k the largest top_k asked, computed only for the rows of
    jobs that asked for labels (the softmax is most of the cost); other rows are zeros.
    None, None if no job asked."""
    wanted = np.fromiter((jobs[j].labels for j in owners[:, 0].tolist()), bool, len(owners))
    if not wanted.any():
        return None, None
    asked = set(owners[wanted, 0].tolist())
    k = min(max(jobs[j].top_k for j in asked), logits.shape[1])
    if wanted.all():
        return postprocessing.top_k_softmax(logits, k)
    ids, scores = postprocessing.top_k_softmax(logits[wanted], k)
    top_ids = np.zeros((len(logits), k), ids.dtype)
    top_scores = np.zeros((len(logits), k), scores.dtype)
    top_ids[wanted], top_scores[wanted] = ids, scores
    return top_ids, top_scores


def _not_finite(owners: np.ndarray, jobs: tuple[Job, ...]) -> dict[tuple[int, int], Failure]:
    """The failures of the images (`owners`' rows) whose outputs are NaN or inf (the model
    overflowed), rather than NaN scores answered as OK: the client's if it sent the model
    input itself (`pixels`), else the server's."""
    failures = {}
    for job, image in owners.tolist():
        if jobs[job].pixels is not None:
            failures[job, image] = Failure(
                int(Code.INVALID_ARGUMENT),
                "the model's output for these pixels is not finite (NaN or inf): are they "
                "scaled and normalized as the model's input is?",
            )
        else:
            failures[job, image] = Failure(
                int(Code.INTERNAL), "the model's output for this image is not finite (NaN or inf)"
            )
    return failures


def _live(owners: np.ndarray, failures) -> np.ndarray:
    """Which rows belong to jobs that have not failed (a boolean mask)."""
    return np.fromiter((j not in failures for j in owners[:, 0].tolist()), bool, len(owners))


def _live_rows(pixels, owners: np.ndarray, failures) -> tuple[object, np.ndarray]:
    """The rows of `pixels` and `owners` whose jobs have not failed."""
    live = _live(owners, failures)
    if live.all():
        return pixels, owners
    rows = np.flatnonzero(live)
    return _take_rows(pixels, rows), owners[rows]


def _take_rows(pixels, rows: np.ndarray):
    """Rows of a host array or of a tensor on the GPU."""
    return pixels[rows] if isinstance(pixels, np.ndarray) else pixels[rows.tolist()]


async def _in_pieces(submit: Callable[[object], Awaitable[R]], pixels, step: int) -> list[R]:
    """submit() each piece of at most `step` rows (pieces batch independently), in order. A
    lone piece is awaited directly; when one piece fails the others are dropped."""
    if len(pixels) <= step:
        return [await submit(pixels)]
    pieces = [
        asyncio.ensure_future(submit(pixels[i : i + step])) for i in range(0, len(pixels), step)
    ]
    try:
        return await asyncio.gather(*pieces)
    except BaseException:
        for piece in pieces:
            piece.cancel()
        raise
