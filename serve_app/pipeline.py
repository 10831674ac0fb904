"""How the ingress reaches the model: the three topologies, each one object with `classify()`.

chained  Ingress -> Preprocess -> Inference -> Postprocess: a chain of 3 Ray calls, chained
         with DeploymentResponse arguments so the ingress awaits only the last; under load
         one chain carries many requests (micro-batching). Each stage scales on its own (many
         CPU decode replicas, a few GPU inference replicas, across nodes).
fused    decode in the ingress replica's thread pool, postprocess in the Inference replica:
         at most 1 Ray call per request, and under load one call carries many requests
         (micro-batching). Fewer hops, lower latency and CPU cost on one host; decode scales
         with ingress threads rather than replicas.
direct   the whole pipeline in the ingress replica (decode, batching, engine, postprocess):
         no Ray call per request. Replicas share the port (SO_REUSEPORT) and each batches
         only the connections the kernel gave it; scale by adding replicas (one process
         each, fractions of a GPU).

A Ray call costs milliseconds of CPU whatever it carries, so under load micro-batching is
what keeps the serving path cheap: while `max_calls_in_flight` calls (or chains) are in
flight, new requests queue, and the next call carries all of them (up to
`requests_per_call`); at low load a lone request goes at once (docs/benchmarks.md).
"""

from __future__ import annotations

import abc
from typing import Protocol

from ray.serve.handle import DeploymentHandle

from serve_app.batching import DynamicBatcher
from serve_app.config import AppConfig
from serve_app.inference import Inference
from serve_app.messages import Classified, Preprocessed
from serve_app.stages import Preprocessor


class Pipeline(Protocol):
    async def classify(
        self,
        images: list[bytes],
        top_k: int,
        deadline: float | None = None,
        scores: bool = False,
        flow: str = "",
    ) -> Classified:
        """`deadline` (a time.time() value): past it, the request's work is dropped wherever
        it is waiting, before the engine (DeadlineExceeded). `scores`: every image's outcome
        also carries every class's probability. `flow`: the stream or connection it came on
        (flows share the decoders in turn)."""
        ...

    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified:
        """The same for a client's already-preprocessed float32 tensor (its deadline in
        `pre.deadline`): no decoding."""
        ...


# A request that waits this long for a call because every call in flight is busy goes in a
# call of its own (up to as many extra calls as max_calls_in_flight): a call can be stuck for
# seconds on one client's expensive images, and must not hold every other client's requests.
SPILL_AFTER_S = 0.02


def _micro_batcher(config: AppConfig, call) -> DynamicBatcher:
    """Requests queued while `max_calls_in_flight` calls run go together in the next."""
    return DynamicBatcher(
        call,
        lambda item: 1,
        max_batch_size=config.requests_per_call,
        max_concurrent=config.max_calls_in_flight,
        max_queued=1 << 20,  # bounded upstream: streams stop reading past their limit
        spill_after_s=SPILL_AFTER_S,
        max_spill=config.max_calls_in_flight,
    )


async def _own_result(batcher: DynamicBatcher, item: tuple, deadline: float | None):
    """One request through a micro-batched call: its own result, or its own failure."""
    result, _ = await batcher.submit(item, deadline)
    if isinstance(result, Exception):
        raise result
    return result


class ChainedPipeline:
    """Each stage in deployments of its own; requests go in micro-batched chains of calls,
    each stage's `many` method answering every request of its call."""

    def __init__(
        self,
        config: AppConfig,
        preprocess: DeploymentHandle,
        inference: DeploymentHandle,
        postprocess: DeploymentHandle,
    ) -> None:
        self._preprocess, self._inference, self._postprocess = preprocess, inference, postprocess
        self._images = _micro_batcher(config, self._chain)
        self._pixels = _micro_batcher(config, self._chain_preprocessed)

    async def _chain(
        self, items: list[tuple[list[bytes], float | None, str, int, bool]]
    ) -> list[Classified | Exception]:
        preprocessed = self._preprocess.many.remote([item[:3] for item in items])
        return await self._infer_and_postprocess(preprocessed, [item[3:] for item in items])

    async def _chain_preprocessed(
        self, items: list[tuple[Preprocessed, int, bool]]
    ) -> list[Classified | Exception]:
        pres = [pre for pre, _, _ in items]
        return await self._infer_and_postprocess(pres, [item[1:] for item in items])

    async def _infer_and_postprocess(
        self, preprocessed, asks: list[tuple[int, bool]]
    ) -> list[Classified | Exception]:
        """`asks`: each request's (top_k, scores)."""
        inferred = self._inference.infer_many.remote(preprocessed)
        return await self._postprocess.many.remote(inferred, asks)

    async def classify(
        self,
        images: list[bytes],
        top_k: int,
        deadline: float | None = None,
        scores: bool = False,
        flow: str = "",
    ) -> Classified:
        item = (images, deadline, flow, top_k, scores)
        return await _own_result(self._images, item, deadline)

    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified:
        return await _own_result(self._pixels, (pre, top_k, scores), pre.deadline)


class _DecodesHere(abc.ABC):
    """Pipelines that decode in this replica's thread pool, then pass the crops on."""

    _preprocessor: Preprocessor

    async def classify(
        self,
        images: list[bytes],
        top_k: int,
        deadline: float | None = None,
        scores: bool = False,
        flow: str = "",
    ) -> Classified:
        preprocessed = await self._preprocessor.run(images, deadline, flow)
        return await self.classify_preprocessed(preprocessed, top_k, scores)

    @abc.abstractmethod
    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified: ...


class FusedPipeline(_DecodesHere):
    """Decode here; send requests to Inference in micro-batched calls."""

    def __init__(self, config: AppConfig, inference: DeploymentHandle) -> None:
        self._preprocessor = Preprocessor(config)
        self._inference = inference
        self._calls = _micro_batcher(config, self._call)

    async def _call(
        self, items: list[tuple[Preprocessed, int, bool]]
    ) -> list[Classified | Exception]:
        return await self._inference.classify_many.remote(items)

    async def classify_preprocessed(
        self, pre: Preprocessed, top_k: int, scores: bool = False
    ) -> Classified:
        return await _own_result(self._calls, (pre, top_k, scores), pre.deadline)


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
