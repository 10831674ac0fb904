"""The preprocess stage: every job's encoded images decoded to crops for the engine, in the
fair decode pool (serve_app/decode_pool.py); a bad image fails alone. With `decode: gpu` it
only checks the headers of the JPEGs nvJPEG can take and leaves them encoded for the inference
stage's GPU decoder (engines/gpu_decode.py). Plain code: the Preprocess deployment hosts it,
or the Inference deployment or the ingress where the topology fuses them.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from engines import images as preprocessing
from engines.images import InvalidImage
from engines.repository import ModelRef, PreprocessSpec, resolve
from serve_app.config import AppConfig
from serve_app.decode_pool import DecodePool
from serve_app.errors import Code, code_for, message_for
from serve_app.messages import NO_OWNERS, Batch, Failure, StageTiming

_GPU = "gpu"  # marks an image left encoded for the GPU decoder


def load_model(config: AppConfig) -> ModelRef:
    return resolve(config.model_repository, config.model, config.model_version)


def decode_limits(config: AppConfig) -> preprocessing.DecodeLimits:
    return preprocessing.DecodeLimits(config.limits.max_image_bytes, config.limits.max_image_pixels)


def _owners(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, np.int32).reshape(-1, 2) if pairs else NO_OWNERS


class PreprocessStage:
    def __init__(self, config: AppConfig, spec: PreprocessSpec) -> None:
        self._spec = spec
        self._limits = decode_limits(config)
        self._gpu = config.decode == "gpu"
        self._pool = DecodePool(
            config.preprocess_threads,
            self._cost,
            self._decode,
            config.limits.max_request_pixels,
        )

    def _cost(self, data: bytes) -> int:
        return preprocessing.decode_cost(data, self._spec, self._limits)

    def _decode(self, data: bytes) -> np.ndarray | str:
        if self._gpu:
            with preprocessing.open_checked(data, self._limits) as image:
                if preprocessing.gpu_decodable(image, data):
                    return _GPU
        return preprocessing.decode(data, self._spec, self._limits)

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
            *(
                self._pool.run(
                    list(batch.jobs[i].images), batch.jobs[i].flow, batch.jobs[i].deadline
                )
                for i in todo
            ),
            return_exceptions=True,
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
                elif isinstance(result, str):
                    jpegs.append(batch.jobs[job].images[image])
                    jpeg_owners.append((job, image))
                else:
                    crops.append(result)
                    crop_owners.append((job, image))
        timing = StageTiming(preprocess_ms=(time.perf_counter() - start) * 1000.0)
        return batch.replace(
            jobs=tuple(
                job if job.pixels is not None else job.without_inputs() for job in batch.jobs
            ),
            crops=np.stack(crops) if crops else None,
            crop_owners=_owners(crop_owners),
            jpegs=tuple(jpegs),
            jpeg_owners=_owners(jpeg_owners),
            image_failures=image_failures,
            job_failures=failures,
            timing=timing,
        )
