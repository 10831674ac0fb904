"""How the ingress reaches the model: the two topologies, each one object with `classify()`.

chained  Ingress -> Preprocess -> Inference -> Postprocess: 3 Ray calls per request, chained
         with DeploymentResponse arguments so the ingress awaits only the last. Each stage
         scales on its own (many CPU decode replicas, a few GPU inference replicas, across
         nodes).
fused    decode in the ingress replica's thread pool, postprocess in the Inference replica:
         at most 1 Ray call per request, and under load one call carries many requests
         (micro-batching). Fewer hops, lower latency and CPU cost on one host; decode scales
         with ingress threads rather than replicas.
direct   the whole pipeline in the ingress replica (decode, batching, engine, postprocess):
         no Ray call per request. Replicas share the port (SO_REUSEPORT) and each batches
         only the connections the kernel gave it; scale by adding replicas (one process
         each, fractions of a GPU).
"""

from __future__ import annotations

import abc
from typing import Protocol

from ray.serve.handle import DeploymentHandle

from serve_app.batching import DynamicBatcher
from serve_app.config import AppConfig
from serve_app.messages import Classified, Preprocessed
from serve_app.stages import Inference, Preprocessor


class Pipeline(Protocol):
    async def classify(
        self, images: list[bytes], top_k: int, deadline: float | None = None, scores: bool = False
    ) -> Classified:
        """`deadline` (a time.time() value): past it, the request's work is dropped wherever
        it is waiting, before the engine (DeadlineExceeded). `scores`: every image's outcome
        also carries every class's probability."""
        ...

    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified:
        """The same for a client's already-preprocessed float32 tensor (its deadline in
        `pre.deadline`): no decoding."""
        ...


class ChainedPipeline:
    def __init__(
        self,
        preprocess: DeploymentHandle,
        inference: DeploymentHandle,
        postprocess: DeploymentHandle,
    ) -> None:
        self._preprocess, self._inference, self._postprocess = preprocess, inference, postprocess

    async def classify(
        self, images: list[bytes], top_k: int, deadline: float | None = None, scores: bool = False
    ) -> Classified:
        preprocessed = self._preprocess.remote(images, deadline)
        inferred = self._inference.remote(preprocessed)
        return await self._postprocess.remote(inferred, top_k, scores)

    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified:
        return await self._postprocess.remote(self._inference.remote(pre), top_k, scores)


class _DecodesHere(abc.ABC):
    """Pipelines that decode in this replica's thread pool, then pass the crops on."""

    _preprocessor: Preprocessor

    async def classify(
        self, images: list[bytes], top_k: int, deadline: float | None = None, scores: bool = False
    ) -> Classified:
        preprocessed = await self._preprocessor.run(images, deadline)
        return await self.classify_preprocessed(preprocessed, top_k, scores)

    @abc.abstractmethod
    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified: ...


class FusedPipeline(_DecodesHere):
    """Decode here; send requests to Inference in micro-batches: while `max_calls` Ray calls
    are in flight, new requests queue, and the next call carries all of them (up to
    `requests_per_call`). A Ray call costs milliseconds of CPU whatever it carries, so under
    load this is what keeps the serving path cheap (docs/benchmarks.md)."""

    def __init__(self, config: AppConfig, inference: DeploymentHandle) -> None:
        self._preprocessor = Preprocessor(config)
        self._inference = inference
        self._calls: DynamicBatcher = DynamicBatcher(
            self._call,
            lambda item: 1,
            max_batch_size=config.requests_per_call,
            max_concurrent=config.max_calls_in_flight,
            max_queued=1 << 20,  # bounded upstream: streams stop reading past their limit
        )

    async def _call(
        self, items: list[tuple[Preprocessed, int, bool]]
    ) -> list[Classified | Exception]:
        return await self._inference.classify_many.remote(items)

    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified:
        result, _ = await self._calls.submit((pre, top_k, scores), pre.deadline)
        if isinstance(result, Exception):
            raise result
        return result


class LocalPipeline(_DecodesHere):
    """topology direct: decode in this process' thread pool, then this process' Inference
    code (its dynamic batcher batches across every stream this replica serves)."""

    def __init__(self, config: AppConfig, inference: Inference) -> None:
        self._preprocessor = Preprocessor(config)
        self._inference = inference

    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified:
        return await self._inference(pre, top_k, scores)
