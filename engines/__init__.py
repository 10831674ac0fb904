"""Inference engines behind one protocol (`engines.base.Engine`), chosen by configuration."""

from __future__ import annotations

import importlib.util
import logging
from typing import Literal, get_args

from engines.base import Engine, EngineError, EngineInfo, Outputs
from engines.repository import ModelRef

logger = logging.getLogger(__name__)

# The one list of engine kinds: `engine.kind` in the config, `create_engine`, the CLI's
# --engine. echo: no model, fixed logits; for transport benchmarks and tests only.
EngineKind = Literal["auto", "onnxruntime", "torch-cuda", "tensorrt", "echo"]
KINDS: tuple[str, ...] = get_args(EngineKind)

__all__ = [
    "KINDS",
    "Engine",
    "EngineError",
    "EngineInfo",
    "EngineKind",
    "Outputs",
    "create_engine",
    "pick_engine",
]


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pick_engine(kind: EngineKind) -> str:
    """`auto`: torch-CUDA on a GPU, else ONNX Runtime on the CPU. Never TensorRT, which has
    never run anywhere (docs/known-limits.md): it runs only when asked for by name."""
    if kind != "auto":
        return kind
    return "torch-cuda" if _cuda_available() else "onnxruntime"


def create_engine(
    kind: EngineKind,
    model: ModelRef,
    *,
    max_batch_size: int = 64,
    precision: str = "fp16",
    **options: object,
) -> Engine:
    """Build the engine `kind` for `model`, taking batches of up to `max_batch_size` images;
    raises EngineError saying what to change."""
    chosen = pick_engine(kind)
    if chosen == "echo":  # transport benchmarks only: fixed logits, no model
        from engines.echo import EchoEngine

        return EchoEngine(model, max_batch_size=max_batch_size, **options)
    if chosen == "onnxruntime":
        from engines.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(model, max_batch_size=max_batch_size, **options)
    if chosen == "tensorrt":
        logger.warning(
            "engine 'tensorrt' is experimental: it has never run on any machine (the "
            "tensorrt package was not installable where raystream was tested); prefer "
            "torch-cuda"
        )
    if chosen in ("torch-cuda", "tensorrt") and not _cuda_available():
        raise EngineError(
            f"engine {chosen!r} needs a CUDA GPU and none is visible to this "
            f"replica; give the inference deployment `num_gpus` in "
            f"ray_actor_options, or set engine: onnxruntime"
        )
    if chosen == "torch-cuda":
        from engines.torch_cuda import TorchCudaEngine

        return TorchCudaEngine.from_model(
            model, max_batch_size=max_batch_size, precision=precision, **options
        )
    if chosen == "tensorrt":
        from engines.tensorrt import TensorRTEngine

        return TensorRTEngine(model, max_batch_size=max_batch_size, precision=precision, **options)
    raise EngineError(f"unknown engine {kind!r}; choose one of {', '.join(KINDS)}")
