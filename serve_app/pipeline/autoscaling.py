"""Serve's autoscaling for the stage deployments, counting the calls over their own ports.

Serve scales a deployment on its requests in flight (running at its replicas and queued at
its callers' handles) against `target_ongoing_requests` per replica. Calls over the stage
ports (`stage_ports`, serve_app/transport/stage_port.py) are not Serve requests, so each stage
replica reports its port's calls in flight as a custom metric (`Stages.record_autoscaling_stats`,
serve_app/app.py) and this policy adds them to Serve's count. Over handles the metric stays 0
and the policy decides as Serve's default does. Serve applies the rest of the
autoscaling_config around it (min and max replicas, delays, scaling factors).

A deployment's autoscaling_config names it:

    autoscaling_config:
      policy: {policy_function: serve_app.pipeline.autoscaling:stage_calls_policy}

and `raystream serve` names it for every autoscaled stage deployment that names no policy.
Serve sends the function to its controller by value: this module imports nothing of raystream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

POLICY = "serve_app.pipeline.autoscaling:stage_calls_policy"
PORT_CALLS = "stage_port_calls"  # the custom metric: calls in flight over a replica's port


def stage_calls_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Replicas wanted: Serve's requests and the port calls in flight, over the target each."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    port_calls = sum((ctx.aggregated_metrics or {}).get(PORT_CALLS, {}).values())
    in_flight = ctx.total_num_requests + port_calls
    return in_flight / ctx.config.get_target_ongoing_requests(), {}
