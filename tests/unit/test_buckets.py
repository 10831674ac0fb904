"""Bucket selection and plans, shared by the torch-CUDA and TensorRT engines."""

import pytest

from engines.buckets import BucketPlanner, buckets_up_to, smallest_bucket


def test_buckets_end_at_the_max() -> None:
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_up_to(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert buckets_up_to(1) == (1,)
    with pytest.raises(ValueError, match="at least 1"):
        buckets_up_to(0)


def test_smallest_bucket() -> None:
    assert [smallest_bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="larger than the largest bucket 8"):
        smallest_bucket(9, (1, 2, 4, 8))


def test_plan_without_latencies_pads_up() -> None:
    planner = BucketPlanner((1, 2, 4, 8))
    assert planner.plan(3) == (4,)
    assert planner.plan(8) == (8,)
    assert planner.plan(19) == (8, 8, 4)


def test_plan_with_latencies_splits_when_cheaper() -> None:
    # Padding 65 to 128 costs 10 ms; 64 + 1 costs 5 + 1 ms.
    latency = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3, 16: 1.6, 32: 2.5, 64: 5.0, 128: 10.0}
    planner = BucketPlanner(tuple(latency), latency)
    assert planner.plan(65) == (64, 1)
    assert planner.plan(3) == (4,)  # one padded launch beats 2 + 1
    assert planner.plan(128) == (128,)
    for n in range(1, 300):
        plan = planner.plan(n)
        assert sum(plan) >= n
        assert sum(plan) - n < max(latency)  # never a whole useless piece


def test_plan_needs_every_latency() -> None:
    with pytest.raises(ValueError, match=r"missing for buckets \[4\]"):
        BucketPlanner((1, 2, 4), {1: 1.0, 2: 1.0})
