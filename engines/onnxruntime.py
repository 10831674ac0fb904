"""ONNX Runtime engine: the CPU default."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort

from engines.base import Engine, EngineError, EngineInfo, Outputs
from engines.repository import OUTPUT_NAMES, ModelRef

logger = logging.getLogger(__name__)


class OnnxRuntimeEngine(Engine):
    def __init__(
        self,
        model: ModelRef,
        *,
        max_batch_size: int = 64,
        threads: int = 0,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
        allow_spinning: bool = False,
    ) -> None:
        """allow_spinning: ONNX Runtime's threads spin a while after each piece of work
        instead of sleeping (ONNX Runtime's own default). Off here: a server's decoding and
        gRPC share the engine's cores, and the spinning took their CPU. On 2 cores the chained
        CPU default spent 12.2 CPU ms an image without it against 13.8 with it (152.6 against
        141.9 img/s, 4 runs each), and decode + engine in one process lost nothing."""
        if not model.onnx_path.is_file():
            raise EngineError(f"{model.onnx_path} is missing; run `raystream export`")
        if changed := model.changed_since_export(model.onnx_path):
            raise EngineError(changed)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads  # 0: one per physical core
        # The memory planned per input shape (ONNX Runtime's default) grows with each new
        # batch size a server's dynamic batches bring: +211 MB over 40 random sizes of 1-64
        # after a batch of 64, against +89 without it, at the same speed within this 2-core
        # machine's drift (2026-12-06).
        options.enable_mem_pattern = False
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
        )
        self._session = ort.InferenceSession(str(model.onnx_path), options, providers=providers)
        self._input = self._session.get_inputs()[0].name
        dim = model.spec.embedding_dim
        names = [output.name for output in self._session.get_outputs()]
        expected = list(OUTPUT_NAMES if dim else OUTPUT_NAMES[:1])
        if names != expected:
            raise EngineError(
                f"{model.onnx_path} has outputs {names}, its model.json says {expected}; "
                f"re-run `raystream export`"
            )
        size = model.spec.preprocess.input_size
        self.info = EngineInfo(
            engine="onnxruntime",
            input_shape=(3, size, size),
            num_classes=model.spec.num_classes,
            max_batch_size=max_batch_size,
            precision="fp32",
            device="cpu",
            embedding_dim=dim,
        )
        logger.info(
            "ONNX Runtime %s session on %s (%s)",
            ort.__version__,
            model.onnx_path,
            ",".join(self._session.get_providers()),
        )

    def warmup(self) -> None:
        """A batch of one, then the largest: the arena grows to its size before the server
        reports ready, and the first full batch pays nothing."""
        c, h, w = self.info.input_shape
        for size in sorted({1, self.info.max_batch_size}):
            self.infer(np.zeros((size, c, h, w), np.float32))

    def _infer(self, batch: np.ndarray) -> Outputs:
        results = self._session.run(None, {self._input: batch})
        if len(results) == 1:
            return Outputs.logits_only(results[0])
        return Outputs(*results)

    def close(self) -> None:
        self._session = None
