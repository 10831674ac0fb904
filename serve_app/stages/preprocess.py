"""The preprocess stage: every job's encoded images decoded to crops for the engine, in the
fair decode pool (serve_app/stages/decode_pool.py); a bad image fails alone. With `decode: gpu` the
JPEGs nvJPEG can take (engines/jpeg.py reads their headers, on this thread: microseconds) go
to nvJPEG (engines/gpu_decode.py); only the others go to the pool. The inference stage
decodes them (its engine batches start as each piece is decoded), or with
`experimental.preprocess_decodes_on_gpu` this stage does, in a Preprocess deployment of its
own, and the crops go on to Inference on the GPU (serve_app/transport/device_crops.py). Plain
code: the Preprocess deployment hosts it, or the Inference deployment or the ingress where
the topology fuses them.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from engines import images as preprocessing
from engines.images import InvalidImage
from engines.jpeg import nvjpeg_size
from engines.repository import ModelRef, PreprocessSpec, resolve
from serve_app.config import AppConfig
from serve_app.core.messages import NO_OWNERS, Batch, Failure, StageTiming, fail_jobs
from serve_app.errors import Code, code_for, message_for
from serve_app.stages.decode_pool import DecodePool, decode_limits
from serve_app.stages.nvjpeg_queue import NvjpegQueue
from serve_app.tuning import DECODE_BATCH, DEFAULT_PREPROCESS_THREADS, MAX_REQUEST_PIXELS


def load_model(config: AppConfig) -> ModelRef:
    versions = config.default_model_versions  # the first pinned, else the highest
    return resolve(config.model_repository, config.model, versions[0] if versions else "")


def _owners(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, np.int32).reshape(-1, 2) if pairs else NO_OWNERS


class PreprocessStage:
    """`decodes`: the JPEGs left for nvJPEG are decoded here too
    (experimental.preprocess_decodes_on_gpu); `threads`: the CPU decode threads. `await warm()`
    before the first call."""

    def __init__(
        self,
        config: AppConfig,
        spec: PreprocessSpec,
        decodes: bool = False,
        threads: int = DEFAULT_PREPROCESS_THREADS,
    ) -> None:
        self._spec = spec
        self._nvjpeg = NvjpegQueue(config, spec) if decodes else None
        self._limits = decode_limits(config)
        self._gpu = config.decode == "gpu"
        self._max_request_pixels = MAX_REQUEST_PIXELS
        self._pool = DecodePool(threads, self._cost, self._decode, MAX_REQUEST_PIXELS)

    async def warm(self) -> None:
        if self._nvjpeg is not None:
            await self._nvjpeg.warm()

    async def close(self) -> None:
        if self._nvjpeg is not None:
            await self._nvjpeg.close()

    def abandon(self) -> None:
        """close() for a stage given up while its decode thread may be stuck."""
        if self._nvjpeg is not None:
            self._nvjpeg.abandon()

    def stalled_s(self) -> float:
        """How long its nvJPEG decode running now has run; 0 if none runs (or none here)."""
        return self._nvjpeg.stalled_s() if self._nvjpeg is not None else 0.0

    def _cost(self, data: bytes) -> int:
        return preprocessing.decode_cost(data, self._spec, self._limits)

    def _decode(self, data: bytes) -> np.ndarray:
        return preprocessing.decode(data, self._spec, self._limits)

    def _for_gpu(self, images: tuple[bytes, ...]) -> tuple[list[int], int]:
        """decode: gpu: which of a request's images go to nvJPEG as they are (within the
        limits and the request's pixel budget), and their pixels; the rest go to the pool."""
        chosen, pixels = [], 0
        for index, data in enumerate(images):
            small_enough = len(data) <= self._limits.max_image_bytes
            size = nvjpeg_size(data, self._spec.resize_size) if small_enough else None
            if size is not None:
                cost = size[0] * size[1]
                if cost <= self._limits.max_pixels and pixels + cost <= self._max_request_pixels:
                    chosen.append(index)
                    pixels += cost
        return chosen, pixels

    async def _decode_job(self, job) -> list:
        """One result per image of `job`: a crop, True (left for the GPU) or InvalidImage."""
        if not self._gpu:
            return await self._pool.run(list(job.images), job.flow, job.deadline)
        chosen, pixels = self._for_gpu(job.images)
        results: list = [True] * len(job.images)
        on_gpu = set(chosen)
        rest = [i for i in range(len(job.images)) if i not in on_gpu]
        if rest:
            decoded = await self._pool.run(
                [job.images[i] for i in rest], job.flow, job.deadline, pixels
            )
            for index, result in zip(rest, decoded, strict=True):
                results[index] = result
        return results

    async def run(self, batch: Batch) -> Batch:
        start = time.perf_counter()
        now = time.time()
        failures = dict(batch.job_failures)
        todo = []
        for index, job in enumerate(batch.jobs):
            if index in failures or not job.images:
                continue
            if job.deadline is not None and now >= job.deadline:
                failures[index] = Failure(
                    int(Code.DEADLINE_EXCEEDED), "deadline passed before decoding"
                )
                continue
            todo.append(index)
        decoded = await asyncio.gather(
            *(self._decode_job(batch.jobs[i]) for i in todo), return_exceptions=True
        )
        crops, crop_owners, jpegs, jpeg_owners = [], [], [], []
        image_failures = dict(batch.image_failures)
        for job, results in zip(todo, decoded, strict=True):
            if isinstance(results, BaseException):  # its deadline passed while queued
                if not isinstance(results, Exception):
                    raise results
                failures[job] = Failure(int(code_for(results)), message_for(results))
                continue
            for image, result in enumerate(results):
                if isinstance(result, InvalidImage):
                    image_failures[job, image] = Failure(int(result.code), str(result))
                elif result is True:
                    jpegs.append(batch.jobs[job].images[image])
                    jpeg_owners.append((job, image))
                else:
                    crops.append(result)
                    crop_owners.append((job, image))
        pixels = np.stack(crops) if crops else None
        if self._nvjpeg is not None and jpegs:
            pixels, crop_owners = await self._decode_on_gpu(
                jpegs, jpeg_owners, pixels, crop_owners, failures, image_failures
            )
            jpegs, jpeg_owners = [], []
        timing = StageTiming(preprocess_ms=(time.perf_counter() - start) * 1000.0)
        return batch.replace(
            jobs=tuple(
                job if job.pixels is not None else job.without_inputs() for job in batch.jobs
            ),
            crops=pixels,
            crop_owners=_owners(crop_owners),
            jpegs=tuple(jpegs),
            jpeg_owners=_owners(jpeg_owners),
            image_failures=image_failures,
            job_failures=failures,
            timing=timing,
        )

    async def _decode_on_gpu(
        self,
        jpegs: list[bytes],
        owners: list[tuple[int, int]],
        host_crops: np.ndarray | None,
        host_owners: list[tuple[int, int]],
        failures: dict[int, Failure],
        image_failures: dict[tuple[int, int], Failure],
    ) -> tuple[object, list[tuple[int, int]]]:
        """The JPEGs through nvJPEG, in pieces of at most DECODE_BATCH decoded with other
        calls' pieces, and the host crops beside them: one tensor on the GPU, and its rows'
        owners. A JPEG nvJPEG refuses fails alone; nvJPEG itself failing fails the jobs of
        its piece."""
        import torch  # decode: gpu only

        starts = range(0, len(jpegs), DECODE_BATCH)
        decoded = await asyncio.gather(
            *(self._nvjpeg.decode(jpegs[lo : lo + DECODE_BATCH]) for lo in starts),
            return_exceptions=True,
        )
        tensors, rows = [], []
        for lo, crops in zip(starts, decoded, strict=True):
            piece = owners[lo : lo + DECODE_BATCH]
            if isinstance(crops, BaseException):
                if not isinstance(crops, Exception):
                    raise crops
                fail_jobs(failures, _owners(piece), crops)
                continue
            for index, error in crops.errors:
                image_failures[piece[index]] = Failure(int(error.code), str(error))
            if len(crops.good):
                tensors.append(crops.pixels)
                rows += [piece[index] for index in crops.good]
        if host_crops is not None:
            device = tensors[0].device if tensors else None
            tensors.append(torch.from_numpy(host_crops).to(device) if device else host_crops)
            rows += host_owners
        if not tensors:
            return None, rows
        # after the pieces' decodes (complete); a process reading the crops by CUDA IPC
        # waits for this stream's work first (torch records an event with the handle)
        return (tensors[0] if len(tensors) == 1 else torch.cat(tensors)), rows
