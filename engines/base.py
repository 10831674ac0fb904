"""The one engine protocol every backend implements.

An engine owns a compiled model and runs float32 NCHW batches to `Outputs`: float32 logits
and, from the same pass, the L2-normalized embedding. The public `infer()` checks the batch
against the engine's input metadata, then calls `_infer()` (the Polygraphy runner pattern),
so every backend gets the same validation and errors.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np


def normalize(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W, C) crops -> float32 (N, C, H, W) with (x / 255 - mean) / std per channel.

    Transposed while still uint8 (a quarter of float32's bytes through the strided copy),
    then scaled in place: 5-6x faster than transposing the float32 result (1.1 against
    6.5 ms for 8 crops on a 2-core CPU machine), the same float32 values.
    """
    scale = (1.0 / (255.0 * std)).astype(np.float32)[:, None, None]
    shift = (-mean / std).astype(np.float32)[:, None, None]
    out = np.ascontiguousarray(images.transpose(0, 3, 1, 2)).astype(np.float32)
    out *= scale
    out += shift
    return out


@dataclass(frozen=True)
class Outputs:
    """One batch's results, a row per image, both from one engine pass."""

    logits: np.ndarray  # float32 (N, classes)
    embedding: np.ndarray  # float32 (N, D), each row of norm 1; (N, 0) for a model without one
    gpu_ms: float = 0.0  # the pass's GPU time (CUDA events) where the engine timed it, else 0

    def __len__(self) -> int:
        return len(self.logits)

    def rows(self, lo: int, hi: int) -> Outputs:
        return Outputs(self.logits[lo:hi], self.embedding[lo:hi])

    def take(self, rows: np.ndarray) -> Outputs:
        return Outputs(self.logits[rows], self.embedding[rows])

    @staticmethod
    def concat(parts: list[Outputs], embedding: bool = True) -> Outputs:
        """The parts' rows in order; with `embedding` False the result's embedding is
        (N, 0): a call that asks for none copies none."""
        if len(parts) == 1:
            return parts[0]
        logits = np.concatenate([p.logits for p in parts])
        if not embedding:
            return Outputs(logits, np.zeros((len(logits), 0), np.float32))
        return Outputs(logits, np.concatenate([p.embedding for p in parts]))

    @staticmethod
    def logits_only(logits: np.ndarray, gpu_ms: float = 0.0) -> Outputs:
        """A model without an embedding output (exported before embeddings existed)."""
        return Outputs(logits, np.zeros((len(logits), 0), np.float32), gpu_ms)


class EngineError(RuntimeError):
    """An engine could not start or run; the message says why and what to change."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine reports about itself (GetModelInfo carries it to clients)."""

    engine: str  # the kind that runs: one of engines.KINDS other than "auto"
    input_shape: tuple[int, int, int]  # (C, H, W); the batch dimension is dynamic
    num_classes: int
    max_batch_size: int
    precision: str  # "fp32", "fp16", "bf16", "int8"
    device: str  # "cpu", "cuda:0", ...
    embedding_dim: int = 0  # width of Outputs.embedding; 0: the model has no embedding output


class Engine(abc.ABC):
    """Load in the constructor, `warmup()` before serving, `infer()` batches, `close()` once.

    Engines are context managers, so tests and benchmarks release GPU memory and graphs
    deterministically instead of relying on `__del__`.
    """

    info: EngineInfo
    # Batches worth running at once: GPU engines overlap one batch's copies with another's
    # compute; ONNX Runtime gives each its share of the cores (serve_app/stages/inference.py).
    batches_at_once: int = 2
    # GPU engines time each pass with CUDA events (Outputs.gpu_ms) while this is set: the
    # inference stage sets it where tracing is on (the engine span's raystream.gpu_ms).
    time_gpu: bool = False

    def warmup(self) -> None:
        """Run every shape the engine will see once, so the first request pays nothing."""
        c, h, w = self.info.input_shape
        self.infer(np.zeros((1, c, h, w), np.float32))

    def infer(self, batch: np.ndarray) -> Outputs:
        """Run a float32 (N, C, H, W) batch, 1 <= N <= max_batch_size: its logits and
        embedding."""
        expected = self.info.input_shape
        if batch.ndim != 4 or tuple(batch.shape[1:]) != expected:
            raise ValueError(
                f"batch must have shape (N, {', '.join(map(str, expected))}), "
                f"got {tuple(batch.shape)}"
            )
        if batch.dtype != np.float32:
            raise ValueError(f"batch must be float32, got {batch.dtype}")
        if not 1 <= batch.shape[0] <= self.info.max_batch_size:
            raise ValueError(
                f"batch size must be in 1..{self.info.max_batch_size}, got {batch.shape[0]}"
            )
        return self._infer(batch)

    def infer_uint8(self, images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> Outputs:
        """Run uint8 (N, H, W, C) crops, normalizing with the model's mean/std first.

        The default normalizes on the CPU; GPU engines override it to upload a quarter of
        the bytes and normalize on the device.
        """
        return self.infer(normalize(images, mean, std))

    @abc.abstractmethod
    def _infer(self, batch: np.ndarray) -> Outputs: ...

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing here
        """Release what the engine holds (sessions, device memory, graphs)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
