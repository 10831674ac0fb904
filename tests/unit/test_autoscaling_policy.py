"""raystream's autoscaling policy as Serve's controller runs it: Serve's count of requests in
flight plus the calls in flight over the stage ports, against the target per replica."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.pipeline.autoscaling import POLICY, PORT_CALLS


def _context(config, replicas: int, requests: float, port_calls: list[float] | None):
    """`port_calls`: each replica's metric; None: no replica has reported one yet."""
    metrics = {} if port_calls is None else {PORT_CALLS: dict(enumerate(port_calls))}
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="Preprocess",
        app_name="raystream",
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=[],
        total_num_requests=requests,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


@pytest.fixture
def config() -> AutoscalingConfig:
    # As a Serve config names it: Serve imports the function and sends it to its controller.
    return AutoscalingConfig(
        min_replicas=1,
        max_replicas=4,
        target_ongoing_requests=2,
        policy={"policy_function": POLICY},
    )


@pytest.mark.parametrize(
    ("requests", "port_calls", "wanted"),
    [
        (0.0, [6.0], 3.0),  # calls over the port alone: Serve's own count sees none of them
        (4.0, [0.0], 2.0),  # by handle alone: Serve's default decision
        (2.0, [3.0, 1.0], 3.0),  # both, summed over the replicas
    ],
)
def test_port_calls_count_as_requests(config, requests, port_calls, wanted) -> None:
    policy = config.policy.get_policy()
    replicas, state = policy(_context(config, 2, requests, port_calls))
    assert replicas == pytest.approx(wanted) and state == {}


def test_no_metric_yet_decides_as_serve_does(config) -> None:
    context = _context(config, 1, 3.0, None)  # a new replica that has not reported yet
    assert config.policy.get_policy()(context)[0] == pytest.approx(1.5)
