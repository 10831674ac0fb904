"""Prometheus metrics, exported through Ray's metrics agent (`ray start --metrics-export-port`;
Ray prefixes every name with `ray_`). Named and labelled after Triton's `nv_inference_*`.

    raystream_inference_request_total{code}    requests answered, by gRPC status code name
    raystream_inference_image_total{code}      images answered, by status code name
    raystream_request_duration_ms              end to end in the ingress (histogram)
    raystream_stage_duration_ms_total{stage}   ms in dispatch (waiting in the ingress for a
                                               call)/queue/preprocess/compute/postprocess,
                                               summed over requests answered OK (Triton's
                                               nv_inference_*_duration_us counters)
    raystream_batch_size                       images per engine batch (histogram)
    raystream_engine_image_total               images through the engine: over the batches'
                                               count, the exact mean batch size
    raystream_stage_port_calls_in_flight       stage calls over a replica's own port that its
                                               stages hold (gauge; Serve's
                                               ray_serve_replica_processing_queries counts
                                               only the calls by handle)
    raystream_requests_in_flight               requests being answered (gauge)
    raystream_rejected_request_total{code}     requests refused: overload, duplicate id, limits
    raystream_cache_image_total{result}        images looked up in the result cache (if on):
                                               hit, miss (sent to the stages), shared (waited
                                               for an identical image in flight)
    raystream_cache_eviction_total             entries the result cache dropped for room
    raystream_cache_bytes, raystream_cache_entries   its size now (gauges)
    raystream_stage_calls_total{callee,transport,outcome}   calls to the stage deployment
                                               `callee` (`stage_ports`; Serve's own
                                               `deployment` tag names the caller):
                                               transport port or handle; outcome ok,
                                               error (the stage's answer), link_down (the
                                               port failed: the call went elsewhere), busy
                                               (the port refused it at its bound)

Serve adds the deployment, replica and application tags. A stage's mean time per request:
    rate(raystream_stage_duration_ms_total{stage="queue"}[1m])
      / rate(raystream_inference_request_total{code="OK"}[1m])

Counters add up in the replica and reach Ray once a second (`IngressMetrics.flush`): a Ray
metric call with Serve's tags costs microseconds, and the seven a request made cost up to 15%
of a direct replica's requests/s on a 2-core CPU machine; gathering them won back ~9%.
Only the end-to-end histogram is still observed per request: Ray's histograms take one value
a call. With tracing on it is also recorded over OTLP, with exemplars (exemplars.py).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping

from opentelemetry.trace import Span
from ray.serve.metrics import Counter, Gauge, Histogram

from serve_app.observability import exemplars

LATENCY_MS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
# Ray's metrics agent exports a histogram's sum as its buckets' midpoints (the lowest bucket's
# from 0): bounds between the integers put sizes 1 and 2 at their own midpoints, where [0, 1]
# showed a batch of 1 as 0.5. The exact mean comes from raystream_engine_image_total.
BATCH_SIZES = [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5, 128.5, 256.5, 512.5]
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
            description="Requests ended, by gRPC status code (CANCELLED: the client left first).",
        )
        self.images = Counter(
            "raystream_inference_image_total",
            tag_keys=("code",),
            description="Images ended, by gRPC status code (CANCELLED: the client left first).",
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
        # Tracing on: the same histogram again over OTLP, sampled requests' trace ids as its
        # exemplars (serve_app/observability/exemplars.py); None with tracing off.
        self.total_exemplars = exemplars.histogram(
            "raystream_request_duration_ms", LATENCY_MS, "End-to-end request time in the ingress."
        )
        self.stages = Counter(
            "raystream_stage_duration_ms_total",
            tag_keys=("stage",),
            description="Milliseconds per stage, summed over requests answered OK.",
        )
        self.cache_images = Counter(
            "raystream_cache_image_total",
            tag_keys=("result",),
            description="Images looked up in the result cache: hit, miss, shared (in flight).",
        )
        self.cache_evictions = Counter(
            "raystream_cache_eviction_total", description="Result cache entries evicted."
        )
        self.cache_bytes = Gauge(
            "raystream_cache_bytes", description="Bytes held by the result cache."
        )
        self.cache_entries = Gauge(
            "raystream_cache_entries", description="Images held by the result cache."
        )
        # What flush() hands to Ray: (counter, tag key, tag value) -> amount since the last
        self._pending: collections.Counter[tuple[Counter, str, str]] = collections.Counter()

    def record(
        self,
        code: str,
        image_codes: Mapping[str, int],
        total_ms: float,
        stage_ms: dict[str, float],
        span: Span | None = None,
    ) -> None:
        """One answered request: its code, its images' codes (code -> images), its times;
        `span`: its span where it is traced (the latency's exemplar)."""
        pending = self._pending
        pending[self.requests, "code", code] += 1
        if code in REJECTED_CODES and not stage_ms:
            pending[self.rejected, "code", code] += 1
        for image_code, count in image_codes.items():
            pending[self.images, "code", image_code] += count
        for stage, ms in stage_ms.items():
            pending[self.stages, "stage", stage] += ms
        self.total.observe(total_ms)
        if self.total_exemplars is not None:
            self.total_exemplars.record(total_ms, span)

    def record_cache(
        self, counts: Mapping[str, int], evictions: int, size: int, entries: int
    ) -> None:
        """The result cache since the last call: images by outcome, evictions; its size."""
        pending = self._pending
        for result, count in counts.items():
            if count:
                pending[self.cache_images, "result", result] += count
        if evictions:
            pending[self.cache_evictions, "", ""] += evictions
        self.cache_bytes.set(size)
        self.cache_entries.set(entries)

    def flush(self) -> None:
        """Hand the counts gathered since the last flush to Ray: one call per counter and tag."""
        pending, self._pending = self._pending, collections.Counter()
        for (counter, key, value), amount in pending.items():
            if amount > 0:  # Ray's counters refuse increments of 0
                counter.inc(amount, tags={key: value} if key else None)


class InferenceMetrics:
    def __init__(self) -> None:
        self.batch_size = Histogram(
            "raystream_batch_size", boundaries=BATCH_SIZES, description="Images per engine batch."
        )
        self.images = Counter(
            "raystream_engine_image_total", description="Images through the engine."
        )

    def record_batch(self, images: int) -> None:
        """One engine batch of `images`."""
        self.batch_size.observe(images)
        if images:  # Ray's counters refuse increments of 0
            self.images.inc(images)


class StageMetrics:
    """A stage replica's calls over its own port (stage_ports), which Serve does not
    see: set as each call starts and ends, one Ray call each (a call carries many requests)."""

    def __init__(self) -> None:
        self.port_calls = Gauge(
            "raystream_stage_port_calls_in_flight",
            description="Stage calls over this replica's port that its stages hold.",
        )


class StageCallMetrics:
    """Calls from this replica to a stage deployment, by how they travelled and ended."""

    def __init__(self) -> None:
        self._calls = Counter(
            "raystream_stage_calls_total",
            tag_keys=("callee", "transport", "outcome"),
            description="Calls to a stage deployment, by transport (port, handle) and outcome "
            "(ok, error, link_down: the port failed and the call went elsewhere).",
        )

    def count(self, deployment: str, transport: str, outcome: str) -> None:
        self._calls.inc(1, {"callee": deployment, "transport": transport, "outcome": outcome})
