"""The pipeline's CPU stages and their Ray Serve deployments: Preprocess and Postprocess
(Inference, between them, is serve_app/inference.py).

Each call carries a whole request (all of its images), never one image. Preprocessor and
postprocess() are plain code, so the fused topology can host them in the ingress and
inference replicas (serve_app/pipeline.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Hashable

import numpy as np
from ray import serve

from engines.repository import ModelRef, resolve
from serve_app import postprocessing, preprocessing
from serve_app.config import AppConfig
from serve_app.decode_pool import DecodePool
from serve_app.errors import DeadlineExceeded, InvalidImage
from serve_app.messages import (
    Classified,
    ImageFailure,
    ImageOutcome,
    Inferred,
    Preprocessed,
    StageTiming,
)


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def load_model(config: AppConfig) -> ModelRef:
    return resolve(config.model_repository, config.model, config.model_version)


def check_deadline(deadline: float | None, where: str) -> None:
    """Work for a request nobody waits for any more stops here, before the engine."""
    if deadline is not None and time.time() >= deadline:
        raise DeadlineExceeded(f"deadline passed before {where}")


def decode_limits(config: AppConfig) -> preprocessing.DecodeLimits:
    return preprocessing.DecodeLimits(config.limits.max_image_bytes, config.limits.max_image_pixels)


_GPU = object()  # marks an image left encoded for the GPU decoder


class Preprocessor:
    """Decodes a request's images in the fair decode pool (serve_app/decode_pool.py; PIL
    releases the GIL while decoding).

    Hosted by the Preprocess deployment (topology `chained`) or inside the ingress replica
    (topology `fused`). With `decode: gpu` it only checks the headers of the JPEGs that nvJPEG
    can take and passes them on encoded (serve_app/gpu_decode.py)."""

    def __init__(self, config: AppConfig) -> None:
        self._spec = load_model(config).spec.preprocess
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

    def _decode(self, data: bytes) -> np.ndarray | object:
        if self._gpu:
            with preprocessing.open_checked(data, self._limits) as image:
                if preprocessing.gpu_decodable(image, data):
                    return _GPU
        return preprocessing.decode(data, self._spec, self._limits)

    async def run(
        self, images: list[bytes], deadline: float | None = None, flow: Hashable = None
    ) -> Preprocessed:
        """`flow`: the stream or connection the request came on; flows share the decode
        threads in turn."""
        check_deadline(deadline, "decoding")
        start = time.perf_counter()
        decoded = await self._pool.run(images, flow, deadline)
        ok = [i for i, d in enumerate(decoded) if isinstance(d, np.ndarray)]
        size = self._spec.input_size
        pixels = (
            np.stack([decoded[i] for i in ok]) if ok else np.empty((0, size, size, 3), np.uint8)
        )
        failures = tuple(
            ImageFailure(i, int(d.code), str(d))
            for i, d in enumerate(decoded)
            if isinstance(d, InvalidImage)
        )
        jpeg_indices = tuple(i for i, d in enumerate(decoded) if d is _GPU)
        return Preprocessed(
            count=len(images),
            pixels=pixels,
            indices=tuple(ok),
            failures=failures,
            timing=StageTiming(preprocess_ms=ms_since(start)),
            jpegs=tuple(images[i] for i in jpeg_indices),
            jpeg_indices=jpeg_indices,
            deadline=deadline,
        )


def postprocess(
    inferred: Inferred, top_k: int, labels: tuple[str, ...], scores: bool = False
) -> Classified:
    """Softmax + top-k + names for the good images; failures stay at their positions. With
    `scores`, each good image also gets every class's probability.

    Run by the Postprocess deployment (topology `chained`) or inside the Inference replica
    (topology `fused`)."""
    start = time.perf_counter()
    outcomes = [ImageOutcome()] * inferred.count
    for failure in inferred.failures:
        outcomes[failure.index] = ImageOutcome(failure=failure)
    ranked = postprocessing.labels_for(inferred.logits, top_k, labels)
    rows = postprocessing.softmax(inferred.logits) if scores else [None] * len(ranked)
    for index, image_labels, row in zip(inferred.indices, ranked, rows, strict=True):
        outcomes[index] = ImageOutcome(labels=image_labels, scores=row)
    timing = dataclasses.replace(inferred.timing, postprocess_ms=ms_since(start))
    return Classified(tuple(outcomes), timing)


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=32)
class Preprocess:
    def __init__(self, config: dict) -> None:
        self._preprocessor = Preprocessor(AppConfig.model_validate(config))

    async def many(
        self, requests: list[tuple[list[bytes], float | None, str]]
    ) -> list[Preprocessed | Exception]:
        """Topology `chained`: many requests (images, deadline, flow) in one Ray call; each
        one's failure is its own."""
        return await asyncio.gather(
            *(self._preprocessor.run(*request) for request in requests),
            return_exceptions=True,
        )


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
class Postprocess:
    def __init__(self, config: dict) -> None:
        self._labels = load_model(AppConfig.model_validate(config)).spec.labels

    def many(
        self, inferred: list[Inferred | Exception], asks: list[tuple[int, bool]]
    ) -> list[Classified | Exception]:
        """Topology `chained`: many requests' (top_k, scores) in one Ray call; a request
        that failed upstream stays failed."""
        return [
            result
            if isinstance(result, Exception)
            else postprocess(result, top_k, self._labels, scores)
            for result, (top_k, scores) in zip(inferred, asks, strict=True)
        ]
