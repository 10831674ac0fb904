"""Batch-size buckets and their plans: the engine-independent half of graph-captured engines.

A graph-captured engine (torch-CUDA, TensorRT) captures one CUDA graph per bucket. A batch of
n images runs as one or more bucket-sized pieces, each padded up to its bucket. Which pieces
is a plan: with measured per-bucket latencies, `BucketPlanner` picks the cheapest cover of n
(65 images may run faster as 64 + 1 than padded to 128). Both GPU engines share this code,
and it is tested on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_up_to(max_batch_size: int, base: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets at most `max_batch_size`, always ending with `max_batch_size` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    return tuple(sorted({b for b in base if b < max_batch_size} | {max_batch_size}))


def smallest_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds n images."""
    for bucket in sorted(buckets):
        if bucket >= n:
            return bucket
    raise ValueError(f"batch of {n} is larger than the largest bucket {max(buckets)}")


class BucketPlanner:
    """Cheapest way to run n images as bucket-sized pieces, given each bucket's latency.

    Without latencies, the plan is the smallest bucket that holds n (pad up), then pieces of
    the largest bucket for what is left. With latencies (measured at warm-up), a dynamic
    program over n minimises the summed latency of the pieces.
    """

    def __init__(self, buckets: Sequence[int], latency_ms: Mapping[int, float] | None = None):
        self.buckets = tuple(sorted(buckets))
        self.latency_ms = dict(latency_ms or {})
        missing = set(self.buckets) - set(self.latency_ms)
        if self.latency_ms and missing:
            raise ValueError(f"latencies missing for buckets {sorted(missing)}")
        self._plan.cache_clear()

    def plan(self, n: int) -> tuple[int, ...]:
        """Bucket sizes whose sum is at least n, largest first."""
        if n < 1:
            raise ValueError(f"batch must hold at least one image, got {n}")
        return self._plan(n)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one planner per engine, bounded
    def _plan(self, n: int) -> tuple[int, ...]:
        largest = self.buckets[-1]
        if not self.latency_ms:
            pieces = [largest] * ((n - 1) // largest)
            return (*pieces, smallest_bucket(n - largest * len(pieces), self.buckets))
        # cost[i]: cheapest time to run i images; choice[i]: the first piece of that plan.
        cost = [0.0] + [float("inf")] * n
        choice = [0] * (n + 1)
        for i in range(1, n + 1):
            for bucket in self.buckets:
                # The tiny per-piece term breaks ties towards fewer launches.
                c = self.latency_ms[bucket] + 1e-6 + cost[max(0, i - bucket)]
                if c < cost[i]:
                    cost[i], choice[i] = c, bucket
        pieces, i = [], n
        while i > 0:
            pieces.append(choice[i])
            i = max(0, i - choice[i])
        return tuple(sorted(pieces, reverse=True))
