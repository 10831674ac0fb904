"""How the ingress reaches the model: the two topologies, each one object with `classify()`.

chained  Ingress -> Preprocess -> Inference -> Postprocess: 3 Ray calls per request, chained
         with DeploymentResponse arguments so the ingress awaits only the last. Each stage
         scales on its own (many CPU decode replicas, a few GPU inference replicas, across
         nodes).
fused    decode in the ingress replica's thread pool, postprocess in the Inference replica:
         1 Ray call per request. Fewer hops, lower latency and CPU cost on one host; decode
         scales with ingress threads rather than replicas.
"""

from __future__ import annotations

from typing import Protocol

from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.messages import Classified
from serve_app.stages import Preprocessor


class Pipeline(Protocol):
    async def classify(self, images: list[bytes], top_k: int) -> Classified: ...


class ChainedPipeline:
    def __init__(
        self,
        preprocess: DeploymentHandle,
        inference: DeploymentHandle,
        postprocess: DeploymentHandle,
    ) -> None:
        self._preprocess, self._inference, self._postprocess = preprocess, inference, postprocess

    async def classify(self, images: list[bytes], top_k: int) -> Classified:
        preprocessed = self._preprocess.remote(images)
        inferred = self._inference.remote(preprocessed)
        return await self._postprocess.remote(inferred, top_k)


class FusedPipeline:
    def __init__(self, config: AppConfig, inference: DeploymentHandle) -> None:
        self._preprocessor = Preprocessor(config)
        self._inference = inference

    async def classify(self, images: list[bytes], top_k: int) -> Classified:
        preprocessed = await self._preprocessor.run(images)
        return await self._inference.remote(preprocessed, top_k)
