"""The Inference deployment: one engine, and the dynamic batching in front of it.

It batches across every request and stream that reaches the replica, counting a batch in
images (serve_app/batching.py); crops (uint8), client-preprocessed tensors (float32) and
crops already on the GPU batch separately. With `decode: gpu` it also decodes JPEGs with
nvJPEG in batches of its own (serve_app/gpu_decode.py). Topology `direct` hosts this code
in the ingress replica (`Inference.in_process`); the other topologies run it as its own
deployment (serve_app/pipeline.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from ray import serve

from engines import Engine, EngineInfo, create_engine
from engines.repository import ModelRef
from serve_app.batching import AdaptiveWait, DynamicBatcher
from serve_app.config import AppConfig, BatchingConfig
from serve_app.errors import InvalidArgument
from serve_app.messages import Classified, ImageFailure, Inferred, Preprocessed
from serve_app.metrics import InferenceMetrics, resident_memory_bytes
from serve_app.stages import check_deadline, decode_limits, load_model, ms_since, postprocess

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Queued:
    pixels: np.ndarray  # uint8 (n, H, W, 3): one request, or one chunk of a large request
    enqueued: float  # perf_counter() when it entered the batch queue


@dataclass(frozen=True)
class _Ran:
    logits: np.ndarray
    started: float  # perf_counter() when its batch started
    inference_ms: float
    batch_size: int


MAX_CONCURRENT_BATCHES = 2  # GPU engines hold this many slots (engines/cuda_graphs.py)
# decode: gpu: batched nvJPEG calls at once in a replica, of at most this many JPEGs (from
# one or several requests). Part of nvJPEG's work runs on the calling CPU thread, so calls in
# parallel matter more than size: 2 calls of up to 256 delivered 6,577 img/s on one H200
# where 4 calls of 32 (one request each) delivered 7,753 (docs/benchmarks.md, section 2c).
DECODE_BATCHES = 4  # threads; user_config's decode_concurrency (default 4) uses up to this
DECODE_BATCH_IMAGES = 32
# A request's JPEGs reach the decoder in pieces of at most this many, so that idle decode
# threads share a very large request. Smaller pieces did not pay: torchvision runs one nvJPEG
# call at a time per process, and at ~4,200 img/s in requests of 32 pieces of 8 gave p99
# 56 ms where whole requests gave 46 (bench/gpu_latency.py, docs/benchmarks.md section 2f).
DECODE_PIECE = DECODE_BATCH_IMAGES


# pixels kind: uint8 crops already on the GPU (a torch tensor). Compared with ==, never `is`:
# a replica may hold this module's constants twice (pickled by value), and an `is` test sent
# every request to the host path on the H200 (2026-12-01).
ON_DEVICE = "on device"


def _input_kind(pixels) -> object:
    """Which batcher a request's pixels join: np.uint8 or np.float32 host arrays (crops,
    client-preprocessed input), or ON_DEVICE for GPU-decoded crops left on the GPU."""
    return pixels.dtype.type if isinstance(pixels, np.ndarray) else ON_DEVICE


def _warm_engine(config: AppConfig, model: ModelRef) -> Engine:
    engine = create_engine(
        config.engine.kind,
        model,
        max_batch_size=config.engine.max_batch_size,
        precision=config.engine.precision,
        **config.engine.options,
    )
    engine.warmup()
    return engine


def _images_in(items: list[_Queued]) -> int:
    return sum(len(item.pixels) for item in items)


Items = TypeVar("Items")  # a request's JPEGs, or its pixels (an array, or a tensor on the GPU)
R = TypeVar("R")


async def _in_pieces(submit: Callable[[Items], Awaitable[R]], items: Items, step: int) -> list[R]:
    """submit() each piece of at most `step` of `items` (all pieces batch independently);
    their results in order. A lone piece is awaited directly (no task: gather's ~16 us);
    when one piece fails (full queue, deadline) the others are dropped."""
    if len(items) <= step:
        return [await submit(items)]
    starts = range(0, len(items), step)
    pieces = [asyncio.ensure_future(submit(items[i : i + step])) for i in starts]
    try:
        return await asyncio.gather(*pieces)
    except BaseException:
        for piece in pieces:
            piece.cancel()
        raise


@serve.deployment(
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=64,
    user_config=BatchingConfig().model_dump(),
)
class Inference:
    """Owns one engine and batches across every request that reaches this replica.

    `batcher: dynamic` (serve_app/batching.py) forms a batch when the engine can take it;
    `batcher: serve` uses Ray Serve's `@serve.batch`, which forms batches eagerly (kept for
    comparison; see docs/benchmarks.md)."""

    async def __init__(self, config: dict) -> None:
        config = AppConfig.model_validate(config)
        model = load_model(config)
        self._spec = model.spec
        self._mean = model.spec.preprocess.mean_array
        self._std = model.spec.preprocess.std_array
        # Off the event loop: building and warming a GPU engine can take a minute, and in
        # topology direct this loop is Serve's own (serve_app/app.py DIRECT_REPLICA_ENV).
        self._engine = await asyncio.to_thread(_warm_engine, config, model)
        # The engine runs in its own threads so the replica's event loop keeps accepting
        # requests while a batch runs. A CPU engine already uses every core for one batch;
        # a GPU engine overlaps two (its slots). user_config's max_concurrent_batches changes it.
        cpu = self._engine.info.device == "cpu"
        self._default_concurrency = 1 if cpu else MAX_CONCURRENT_BATCHES
        self._executor = ThreadPoolExecutor(MAX_CONCURRENT_BATCHES, thread_name_prefix="engine")
        self._gpu_decoder = None
        if config.decode == "gpu":
            from serve_app.gpu_decode import GpuJpegDecoder

            self._gpu_decoder = GpuJpegDecoder(model.spec.preprocess, decode_limits(config))
            self._decode_executor = ThreadPoolExecutor(DECODE_BATCHES, thread_name_prefix="nvjpeg")
            # Requests waiting here decode together: one nvJPEG call and one resize per
            # distinct image size for up to DECODE_BATCH_IMAGES images; idle threads share
            # what is queued (spread) rather than one of them taking it all.
            self._decode_batcher = DynamicBatcher(
                self._decode_batch,
                len,
                max_batch_size=DECODE_BATCH_IMAGES,
                max_concurrent=DECODE_BATCHES,
                spread=True,
            )
        self._batching = BatchingConfig()
        self._rejected: str | None = None  # the last user_config refused, and why
        self._metrics = InferenceMetrics()
        self._images_inferred = 0
        # GPU-decoded crops stay on the GPU when the engine is there (no copy to the host
        # and back: the decode thread hands the engine device memory).
        self._crops_on_device = self._engine.info.device != "cpu"
        # Crops (uint8), client-preprocessed tensors (float32) and crops already on the GPU
        # batch separately (_input_kind).
        self._batchers = {
            kind: DynamicBatcher(
                self._run_engine,
                len,
                max_batch_size=self._batching.max_batch_size,
                max_concurrent=MAX_CONCURRENT_BATCHES,
                max_queued=self._batching.max_queued_images,
            )
            for kind in (np.uint8, np.float32, ON_DEVICE)
        }
        for batcher in self._batchers.values():
            batcher.set_concurrency(self._default_concurrency)
        if self._gpu_decoder is not None:
            await self._warm_decoder()
        logger.info("engine ready: %s", self._engine.info)

    @classmethod
    async def in_process(cls, config: dict) -> Inference:
        """This replica's code without a replica of its own (topology direct: the ingress
        hosts it), with the default batching until `reconfigure()`."""
        inference = cls.__new__(cls)
        await inference.__init__(config)
        inference.reconfigure(BatchingConfig().model_dump())
        return inference

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
            self._rejected = f"{user_config}: {exc}"
            logger.error("user_config refused, keeping %s: %s", self._batching, self._rejected)
            return
        self._rejected = None
        self._batching = batching
        for batcher in self._batchers.values():
            batcher.max_batch_size = batching.max_batch_size
            batcher.max_delay_s = batching.batch_wait_timeout_s
            batcher.max_queued = batching.max_queued_images
            batcher.set_concurrency(batching.max_concurrent_batches or self._default_concurrency)
            batcher.adaptive = None
            if batching.target_p99_ms > 0:
                batcher.max_delay_s = 0.0  # AdaptiveWait raises it while latency allows
                batcher.adaptive = AdaptiveWait(
                    batching.target_p99_ms, batching.batch_wait_timeout_s
                )
        if self._gpu_decoder is not None:
            self._decode_batcher.max_queued = batching.max_queued_images
            self._decode_batcher.set_concurrency(batching.decode_concurrency)
        self._serve_batch.set_max_batch_size(batching.max_batch_size)
        self._serve_batch.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)
        logger.info("batching: %s", batching)

    def info(self) -> tuple[str, str, EngineInfo]:
        return self._spec.name, self._spec.version, self._engine.info

    def images_inferred(self) -> int:
        """Images this replica's engine has run (tests: dropped work must not count)."""
        return self._images_inferred

    def memory_bytes(self) -> int:
        """Resident memory of this replica's process (soak test)."""
        return resident_memory_bytes()

    def replica_id(self) -> str:
        """This replica's Serve id (operators and tests: which replica answered)."""
        return serve.get_replica_context().replica_id.unique_id

    def batching(self) -> dict:
        """The batching settings in force (tests: user_config changes apply live) and the
        batch wait now in use (the adaptive mode moves it)."""
        return {
            **self._batching.model_dump(),
            "wait_s": self._batchers[np.uint8].max_delay_s,
            "refused": self._rejected,
        }

    async def _run_engine(self, chunks: list) -> list[_Ran]:
        """One engine batch from several requests' pixels; split back per request."""
        start = time.perf_counter()
        kind = _input_kind(chunks[0])
        if len(chunks) == 1:
            pixels = chunks[0]
        elif kind == ON_DEVICE:
            import torch  # only replicas with decode: gpu get here

            # (on this thread's stream, which GPU engines wait for before reading)
            pixels = torch.cat(chunks)
        else:
            pixels = np.concatenate(chunks)
        loop = asyncio.get_running_loop()
        if kind == np.float32:  # preprocessed by the client
            logits = await loop.run_in_executor(self._executor, self._engine.infer, pixels)
        else:
            logits = await loop.run_in_executor(
                self._executor, self._engine.infer_uint8, pixels, self._mean, self._std
            )
        inference_ms = ms_since(start)
        self._images_inferred += len(pixels)
        self._metrics.batch_size.observe(len(pixels))
        bounds = np.cumsum([0] + [len(chunk) for chunk in chunks])
        return [
            _Ran(logits[lo:hi], start, inference_ms, len(pixels))
            for lo, hi in itertools.pairwise(bounds)
        ]

    @serve.batch(
        max_batch_size=32,
        batch_wait_timeout_s=0.0,
        batch_size_fn=_images_in,
        max_concurrent_batches=MAX_CONCURRENT_BATCHES,
    )
    async def _serve_batch(self, items: list[_Queued]) -> list[_Ran]:
        return await self._run_engine([item.pixels for item in items])

    async def _submit(self, chunk, deadline: float | None) -> tuple[_Ran, float]:
        """Run one chunk in a batch: (its result, ms it queued)."""
        if self._batching.batcher == "serve" and _input_kind(chunk) == np.uint8:
            # @serve.batch has no deadlines: checked before queueing
            ran = await self._serve_batch(_Queued(chunk, time.perf_counter()))
            return ran, 0.0
        return await self._batchers[_input_kind(chunk)].submit(chunk, deadline)

    async def classify_many(
        self, items: list[tuple[Preprocessed, int, bool]]
    ) -> list[Classified | Exception]:
        """Topology `fused`: many requests (each with its top_k and whether it wants every
        class's score) in one Ray call; each one's failure is its own."""
        return await asyncio.gather(
            *(self(pre, top_k, scores) for pre, top_k, scores in items), return_exceptions=True
        )

    async def infer_many(self, pres: list[Preprocessed | Exception]) -> list[Inferred | Exception]:
        """Topology `chained`: logits for many requests in one Ray call; a request that
        already failed upstream stays failed, and each one's failure is its own."""

        async def infer(pre: Preprocessed | Exception) -> Inferred:
            if isinstance(pre, Exception):
                raise pre
            return await self._infer(pre)

        return await asyncio.gather(*(infer(pre) for pre in pres), return_exceptions=True)

    async def __call__(
        self, pre: Preprocessed, top_k: int | None = None, scores: bool = False
    ) -> Inferred | Classified:
        """Logits for `pre`; with `top_k` (topology `fused`) postprocessed here as well."""
        inferred = await self._infer(pre)
        if top_k is None:
            return inferred
        return postprocess(inferred, top_k, self._spec.labels, scores)

    async def _decode_jpegs(self, pre: Preprocessed) -> Preprocessed:
        """decode: gpu: turn the request's encoded JPEGs into crops beside its other pixels
        (on the GPU when the engine is there)."""
        from serve_app.gpu_decode import Crops, with_host_crops

        start = time.perf_counter()
        decoded = await _in_pieces(
            lambda jpegs: self._decode_batcher.submit(list(jpegs), pre.deadline),
            pre.jpegs,
            DECODE_PIECE,
        )
        crops = Crops.concat([piece for piece, _ in decoded])
        if not (self._crops_on_device and crops.pixels.is_cuda):
            pixels = np.concatenate([pre.pixels, crops.pixels.cpu().numpy()])
        elif len(pre.pixels):
            pixels = with_host_crops(pre.pixels, crops.pixels)
        else:
            pixels = crops.pixels
        bad = tuple(
            ImageFailure(pre.jpeg_indices[i], int(error.code), str(error))
            for i, error in crops.errors
        )
        timing = dataclasses.replace(
            pre.timing, preprocess_ms=pre.timing.preprocess_ms + ms_since(start)
        )
        return dataclasses.replace(
            pre,
            pixels=pixels,
            indices=pre.indices + tuple(pre.jpeg_indices[i] for i in crops.good),
            failures=pre.failures + bad,
            timing=timing,
            jpegs=(),
            jpeg_indices=(),
        )

    async def _warm_decoder(self) -> None:
        """Every decode thread decodes once, then the engine runs those crops as requests'
        crops reach it (on the GPU or the host), before the replica reports ready."""
        barrier = threading.Barrier(DECODE_BATCHES, timeout=120)

        def warm():
            barrier.wait()  # one job per thread: none may take a second before all started
            return self._gpu_decoder.warmup()

        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self._decode_executor, warm) for _ in range(DECODE_BATCHES)]
        crops = (await asyncio.gather(*jobs))[0].pixels
        if not (self._crops_on_device and crops.is_cuda):
            crops = crops.cpu().numpy()
        await loop.run_in_executor(
            self._executor, self._engine.infer_uint8, crops, self._mean, self._std
        )

    async def _decode_batch(self, requests: list[list[bytes]]) -> list[list]:
        return await asyncio.get_running_loop().run_in_executor(
            self._decode_executor, self._gpu_decoder.crops_many, requests
        )

    async def _infer(self, pre: Preprocessed) -> Inferred:
        check_deadline(pre.deadline, "inference")
        if pre.jpegs:
            if self._gpu_decoder is None:
                raise InvalidArgument(
                    "encoded JPEGs reached an inference replica without decode: gpu"
                )
            pre = await self._decode_jpegs(pre)
        if len(pre.pixels) == 0:
            logits = np.empty((0, self._spec.num_classes), np.float32)
            return Inferred(pre.count, logits, pre.indices, pre.failures, pre.timing)
        shape = self._engine.info.input_shape
        kind = _input_kind(pre.pixels)
        expected = shape if kind == np.float32 else (*shape[1:], 3)
        if kind not in self._batchers or pre.pixels.shape[1:] != expected:
            raise InvalidArgument(
                f"pixels must be uint8 (N, {shape[1]}, {shape[2]}, 3) or float32 "
                f"(N, {', '.join(map(str, shape))}), got {pre.pixels.dtype} {pre.pixels.shape}"
            )
        # A request larger than one batch is split into chunks that batch independently.
        start = time.perf_counter()
        ran = await _in_pieces(
            lambda chunk: self._submit(chunk, pre.deadline),
            pre.pixels,
            self._batching.max_batch_size,
        )
        timing = dataclasses.replace(
            pre.timing,
            queue_ms=max((r.started - start) * 1000.0 for r, _ in ran),
            inference_ms=max(r.inference_ms for r, _ in ran),
            batch_size=max(r.batch_size for r, _ in ran),
        )
        logits = ran[0][0].logits if len(ran) == 1 else np.concatenate([r.logits for r, _ in ran])
        return Inferred(pre.count, logits, pre.indices, pre.failures, timing)
