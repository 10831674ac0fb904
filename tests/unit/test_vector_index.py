"""The index of `raystream index build`: recall@10 against exact search on synthetic clustered
vectors of the real model's 1,280 dimensions, with the kind and nprobe that build_index picks
for their count; query latency; an index over shards, and one that refuses another space.

CI runs 60,000 vectors (an inverted file, as above 50,000). The figure at 1,000,000:
    python tests/unit/test_vector_index.py 1000000
prints recall@10, the build's seconds and the query latency (p50, p99) on one thread."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script, too

from clients.vector_index import (
    DEFAULT_NPROBE,
    TRAIN_SAMPLE,
    kind_for,
    new_index,
    set_nprobe,
)

DIM = 1280
CLUSTERS = 2_000
LATENT = 64  # image embeddings vary along far fewer directions than they have
CHUNK = 50_000
QUERIES = 1_000


class Clustered:
    """Unit vectors around CLUSTERS centres in a LATENT-dimensional subspace of DIM, with a
    little noise in every direction; chunk by chunk, the same chunks each time."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self._basis = rng.normal(size=(LATENT, DIM)).astype(np.float32) / np.sqrt(LATENT)
        self._centres = rng.normal(size=(CLUSTERS, LATENT)).astype(np.float32)

    def chunk(self, seed: int, n: int) -> np.ndarray:
        rng = np.random.default_rng(seed + 1_000)
        z = self._centres[rng.integers(0, CLUSTERS, n)]
        z += 0.6 * rng.normal(size=(n, LATENT)).astype(np.float32)
        x = z @ self._basis + 0.05 * rng.normal(size=(n, DIM)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def chunks(self, count: int) -> Iterator[np.ndarray]:
        for start in range(0, count, CHUNK):
            yield self.chunk(start // CHUNK, min(CHUNK, count - start))


def measure(count: int, queries: int = QUERIES) -> dict[str, float]:
    import faiss

    data = Clustered()
    query = data.chunk(-1, queries)  # not in the index: new images
    best = np.full((queries, 10), -np.inf, np.float32)
    best_rows = np.zeros((queries, 10), np.int64)
    started = time.perf_counter()
    for n, chunk in enumerate(data.chunks(count)):  # exact top 10, a chunk at a time
        scores = query @ chunk.T
        top = np.argpartition(-scores, 10, axis=1)[:, :10]
        merged = np.concatenate([best, np.take_along_axis(scores, top, 1)], axis=1)
        merged_rows = np.concatenate([best_rows, top + n * CHUNK], axis=1)
        keep = np.argsort(-merged, axis=1)[:, :10]
        best = np.take_along_axis(merged, keep, 1)
        best_rows = np.take_along_axis(merged_rows, keep, 1)
    exact_s = time.perf_counter() - started

    started = time.perf_counter()
    step = max(1, count // TRAIN_SAMPLE)
    index = new_index(
        DIM, kind_for(count), lambda: np.concatenate([c[::step] for c in data.chunks(count)])
    )
    for chunk in data.chunks(count):
        index.add(chunk)
    build_s = time.perf_counter() - started
    set_nprobe(index, DEFAULT_NPROBE)

    faiss.omp_set_num_threads(1)  # one query at a time, as `similar` asks
    found, latency = [], []
    for q in query:
        started = time.perf_counter()
        _, rows = index.search(q[None], 10)
        latency.append(time.perf_counter() - started)
        found.append(rows[0])
    recall = np.mean([len(set(f) & set(b)) / 10 for f, b in zip(found, best_rows, strict=True)])
    return {
        "vectors": count,
        "kind": kind_for(count),
        "recall_at_10": float(recall),
        "build_s": build_s,
        "exact_s": exact_s,
        "p50_ms": float(np.percentile(latency, 50) * 1e3),
        "p99_ms": float(np.percentile(latency, 99) * 1e3),
    }


def test_recall_at_10_against_exact_search() -> None:
    result = measure(60_000, queries=300)
    assert result["kind"].startswith("IVF"), result
    assert result["recall_at_10"] >= 0.95, result


if __name__ == "__main__":
    print(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000))
