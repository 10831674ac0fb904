"""Prometheus metrics, exported through Ray's metrics agent (`ray start --metrics-export-port`;
Ray prefixes every name with `ray_`). Named and labelled after Triton's `nv_inference_*`.

    raystream_inference_request_total{code}    requests answered, by gRPC status code name
    raystream_inference_image_total{code}      images answered, by status code name
    raystream_request_duration_ms              end to end in the ingress (histogram)
    raystream_{queue,preprocess,compute,postprocess}_duration_ms   per-stage (histograms)
    raystream_batch_size                       images per engine batch (histogram)
    raystream_requests_in_flight               requests being answered (gauge)
    raystream_rejected_request_total{code}     requests refused: overload, duplicate id, limits

Serve adds the deployment, replica and application tags.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable

from ray.serve.metrics import Counter, Gauge, Histogram

LATENCY_MS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
REJECTED_CODES = {"RESOURCE_EXHAUSTED", "ALREADY_EXISTS", "INVALID_ARGUMENT"}


def resident_memory_bytes() -> int:
    """This process's resident memory (Linux), for the soak test and operators' probes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class IngressMetrics:
    def __init__(self) -> None:
        self.requests = Counter(
            "raystream_inference_request_total",
            tag_keys=("code",),
            description="Requests answered, by gRPC status code.",
        )
        self.images = Counter(
            "raystream_inference_image_total",
            tag_keys=("code",),
            description="Images answered, by gRPC status code.",
        )
        self.rejected = Counter(
            "raystream_rejected_request_total",
            tag_keys=("code",),
            description="Requests refused before running.",
        )
        self.in_flight = Gauge(
            "raystream_requests_in_flight", description="Stream requests being answered."
        )
        self.total = Histogram(
            "raystream_request_duration_ms",
            boundaries=LATENCY_MS,
            description="End-to-end request time in the ingress.",
        )
        self.stages = {
            stage: Histogram(
                f"raystream_{stage}_duration_ms",
                boundaries=LATENCY_MS,
                description=f"Per-request {stage} time.",
            )
            for stage in ("queue", "preprocess", "compute", "postprocess")
        }

    def record(
        self, code: str, image_codes: Iterable[str], total_ms: float, stage_ms: dict[str, float]
    ) -> None:
        self.requests.inc(1, tags={"code": code})
        if code in REJECTED_CODES and not stage_ms:
            self.rejected.inc(1, tags={"code": code})
        for image_code, count in collections.Counter(image_codes).items():
            self.images.inc(count, tags={"code": image_code})  # one call per code, not image
        self.total.observe(total_ms)
        for stage, ms in stage_ms.items():
            self.stages[stage].observe(ms)


class InferenceMetrics:
    def __init__(self) -> None:
        self.batch_size = Histogram(
            "raystream_batch_size", boundaries=BATCH_SIZES, description="Images per engine batch."
        )
