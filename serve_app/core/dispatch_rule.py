"""How the ingress' micro-batching dispatcher (serve_app/core/dispatch.py) is set: worked out
from what the ingress sees at run time, not asked of the user.

The settings follow the engine's device, the replicas of the deployment the ingress calls
(its first stage deployment; the ingress itself in topology `direct`), the ingress replicas
that share the load, and this host's cores. The ingress reads the replica counts again every
RETUNE_S, so replicas added or removed (autoscaling, a redeploy) change the calls in flight
without a restart. The load itself is met by the dispatcher: a call takes what queued while
the others ran, a freed slot gathers for GATHER_S while requests arrive fast, a request that
waited SPILL_AFTER_S goes in an extra call, and a burst spreads over free slots.

The constants (serve_app/tuning.py) reproduce the settings measured on the shipped configs
(docs/performance.md#why-the-shipped-settings): on one GPU host, 32 requests a call, 8 calls
in flight per ingress replica (6 ingress replicas, 12 Inference replicas: 4 calls per
callee replica) and bursts spread in calls of one batch (64 images); on the 2-core CPU
machine, 64 requests a call, 2 calls in flight (fewer, fuller calls: one-image requests 1.24x)
and at most 128 images a call (another stream's request behind a backlog: 4.1 s against 61.3).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from serve_app.core.dispatch import DispatchSettings
from serve_app.tuning import (
    BATCHES_PER_CALL_CPU,
    CALLS_PER_CALLEE_REPLICA,
    MIN_CALLS_GPU,
    REQUESTS_PER_CALL_CPU,
    REQUESTS_PER_CALL_GPU,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fleet:
    """What the ingress sees of the deployments at run time."""

    callee_replicas: int = 1  # live replicas of the deployment it calls (1 in `direct`)
    ingress_replicas: int = 1  # live ingress replicas, which share the load
    cores: int = field(default_factory=lambda: host_cores())  # this host's


def dispatch_settings(
    fleet: Fleet, on_gpu: bool, batch_size: int, local_calls: bool = False
) -> DispatchSettings:
    """The dispatcher's settings. `on_gpu`: the engine runs on a GPU; `batch_size`: the
    largest batch it takes; `local_calls`: the ingress runs the stages itself (`direct`).
    With R the callee's replicas, I the ingress replicas and C this host's cores:

    | setting           | CPU engine                        | GPU engine                  |
    |-------------------|-----------------------------------|-----------------------------|
    | requests per call | 64                                | 32                          |
    | calls in flight   | ceil(4 R / I), at most C (but not | ceil(4 R / I), at least 8   |
    |                   | in `direct`: no call to pay for)  |                             |
    | spread a burst    | never                             | in calls of `batch_size`    |
    |                   |                                   | images, where R >= 2        |
    | images per call   | 2 x `batch_size`                  | no bound                    |

    On the shipped configs: deploy/serve_config.yaml (2 cores, R 1-2, I 1, batch 64):
    64 / 2 / never / 128; serve_config.gpu.yaml (R 12, I 6, batch 64): 32 / 8 / 64 / none;
    bench/configs/serve_config.gpu-chained.yaml (R 8 Preprocess, I 6): the same;
    serve_config.cluster.yaml (R 1, I 1, 4 cores or more): 64 / 4 / never / 128;
    serve_config.direct.yaml: 64 / 4 / never / 128; rayservice.yaml (R 1-4, I 1, batch 256):
    32 / 8-16 / 256 from 2 replicas / none.
    """
    share = math.ceil(CALLS_PER_CALLEE_REPLICA * max(fleet.callee_replicas, 1)
                      / max(fleet.ingress_replicas, 1))  # fmt: skip
    if on_gpu:
        return DispatchSettings(
            requests_per_call=REQUESTS_PER_CALL_GPU,
            calls_in_flight=max(share, MIN_CALLS_GPU),
            spread_images=batch_size if fleet.callee_replicas >= 2 else 0,
        )
    # On a CPU host a call in flight holds a core in some stage: calls past the cores only
    # queue there, each paying a call's CPU (2 against 4 on 2 cores: one-image requests 1.24x).
    calls = share if local_calls else max(min(share, fleet.cores), 1)
    return DispatchSettings(
        requests_per_call=REQUESTS_PER_CALL_CPU,
        calls_in_flight=calls,
        max_images=BATCHES_PER_CALL_CPU * batch_size,
    )


def host_cores() -> int:
    """The cores this process may run on (a container's CPU set, not the whole machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
