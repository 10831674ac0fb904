"""A trivial engine for transport and batching benchmarks/tests: no model, fixed-size outputs.

Never a stand-in for a result: it is selected only by `engine: {kind: echo}`, reports
engine "echo", and its outputs say nothing about the image (class 0 wins, always; every
embedding is the first unit vector), with the model's shapes.
"""

from __future__ import annotations

import time

import numpy as np

from engines.base import Engine, EngineInfo, Outputs
from engines.repository import ModelRef


class EchoEngine(Engine):
    batches_at_once = 1  # nothing to overlap: a second batch would only be one more to form

    def __init__(self, model: ModelRef, *, max_batch_size: int = 64, delay_ms: float = 0.0) -> None:
        """`delay_ms`: each batch takes this long, like a slow model (deadline and drain tests)."""
        self._delay_s = delay_ms / 1000.0
        size = model.spec.preprocess.input_size
        self.info = EngineInfo(
            engine="echo",
            input_shape=(3, size, size),
            num_classes=model.spec.num_classes,
            max_batch_size=max_batch_size,
            precision="none",
            device="cpu",
            embedding_dim=model.spec.embedding_dim,
        )

    def _infer(self, batch: np.ndarray) -> Outputs:
        if self._delay_s:
            time.sleep(self._delay_s)
        logits = np.zeros((len(batch), self.info.num_classes), np.float32)
        logits[:, 0] = 1.0
        embedding = np.zeros((len(batch), self.info.embedding_dim), np.float32)
        embedding[:, :1] = 1.0
        return Outputs(logits, embedding)

    def infer_uint8(self, images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> Outputs:
        return self._infer(images)  # skip normalization: this engine measures the pipeline
