"""Softmax, top-k and label names over a batch of logits. Pure numpy: no Ray, no gRPC."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serve_app.messages import Label


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 for stable probabilities, returned as float32."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k highest probabilities per row, highest first: (class_ids, scores), each (N, k)."""
    k = min(k, probs.shape[1])
    part = np.argpartition(-probs, k - 1, axis=1)[:, :k]
    part_scores = np.take_along_axis(probs, part, axis=1)
    order = np.argsort(-part_scores, axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1)
    return ids, np.take_along_axis(part_scores, order, axis=1)


def labels_for(logits: np.ndarray, k: int, names: Sequence[str]) -> list[tuple[Label, ...]]:
    """Top-k `Label`s for each row of logits."""
    if len(logits) == 0:
        return []
    ids, scores = top_k(softmax(logits), k)
    return [
        tuple(Label(int(c), names[c], float(s)) for c, s in zip(row_ids, row_scores, strict=True))
        for row_ids, row_scores in zip(ids, scores, strict=True)
    ]
