"""The model registry on a real Ray instance (serve_app/models/registry_actor.py): one actor
per application instance, copies kept current by a long poll, heartbeats, expiry, restarts."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from support import until

from serve_app.models import registry_actor
from serve_app.models.registry import ModelRegistry
from serve_app.models.registry_actor import ActorStore, actor_name
from serve_app.tuning import FRESH_S

pytestmark = pytest.mark.slow


@pytest.fixture
def instance(ray_cluster):
    name = uuid.uuid4().hex
    yield name
    import ray

    for store in _stores.pop(name, []):
        store.close()
    ray.kill(ray.get_actor(actor_name(name), namespace=registry_actor.NAMESPACE))


_stores: dict[str, list[ActorStore]] = {}


def _registry(instance: str) -> ModelRegistry:
    store = ActorStore(instance)
    _stores.setdefault(instance, []).append(store)
    return ModelRegistry(store, instance)


async def test_a_write_reaches_every_replicas_copy_without_polling(instance) -> None:
    first, second = _registry(instance), _registry(instance)
    assert first.start(["m/1"]) == {"m/1": "serve"}
    assert second.start(["m/0"]) == {"m/1": "serve"}  # the first one's state, not its own
    first.set_state(["m/2"], "serve")
    await until(lambda: second.desired() == {"m/1": "serve", "m/2": "serve"}, 5)
    second.report("Inference", "r2", ["m/1"], address="127.0.0.1:9100")
    await until(lambda: first.ports("Inference") == {"127.0.0.1:9100": frozenset({"m/1"})}, 5)


async def test_steady_state_costs_a_replica_one_call_a_second_and_a_gone_one_expires(
    instance,
) -> None:
    """Replicas report every POLL_S and read at will; unchanged, a report goes to the actor
    once a HEARTBEAT_S, and no watch wakes. A replica that stops reporting (killed: no
    leave) is gone FRESH_S later; one that leaves, at once."""
    import ray

    replicas = [_registry(instance) for _ in range(3)]
    replicas[0].start(["m/1"])
    actor = ray.get_actor(actor_name(instance), namespace=registry_actor.NAMESPACE)
    for number, replica in enumerate(replicas):  # the first reports: changes, watches wake
        replica.report("Inference", f"r{number}", ["m/1"])
    await until(lambda: all(len(r.reports("Inference")) == 3 for r in replicas), 5)
    seconds = 5.0
    before = ray.get(actor.calls.remote())
    ended = time.monotonic() + seconds
    while time.monotonic() < ended:
        for number, replica in enumerate(replicas):
            await asyncio.to_thread(replica.report, "Inference", f"r{number}", ["m/1"])
            assert replica.desired() == {"m/1": "serve"}  # a read: from the copy
        await asyncio.sleep(0.25)  # pacing: a replica's reports
    after = ray.get(actor.calls.remote())
    calls = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    per_replica_s = sum(calls.values()) / len(replicas) / seconds
    assert per_replica_s <= 1.2, calls  # a heartbeat a second
    # no watch woke: at most each replica's re-armed after the first reports' last change
    assert calls.get("watch", 0) <= len(replicas) and calls.get("snapshot", 0) == 0
    replicas[1].leave("Inference", "r1")
    await until(lambda: len(replicas[0].reports("Inference")) == 2, 2)
    started = time.monotonic()
    while len(replicas[0].reports("Inference")) > 1:  # r2 stopped reporting: it expires
        await asyncio.to_thread(replicas[0].report, "Inference", "r0", ["m/1"])
        assert time.monotonic() - started < FRESH_S + 3
        await asyncio.sleep(0.25)  # pacing: r0's reports go on
    assert [report.replica for report in replicas[0].reports("Inference")] == ["r0"]


async def test_a_restarted_registry_keeps_the_desired_state_and_gets_the_reports_back(
    instance,
) -> None:
    import ray

    replica = _registry(instance)
    replica.start(["m/1"])
    replica.set_state(["m/1"], "drain")
    actor = ray.get_actor(actor_name(instance), namespace=registry_actor.NAMESPACE)
    ray.kill(actor, no_restart=False)
    await until(lambda: _alive(actor), 30)
    fresh = _registry(instance)
    assert fresh.desired() == {"m/1": "drain"}  # kept in the GCS across the restart
    await asyncio.to_thread(replica.report, "Inference", "r0", ["m/1"])
    await until(lambda: [r.replica for r in fresh.reports("Inference")] == ["r0"], 10)


def _alive(actor) -> bool:
    import ray

    try:
        ray.get(actor.calls.remote(), timeout=1)
    except Exception:
        return False
    return True


async def test_two_hundred_replicas_gone_leave_only_the_live_and_the_desired_state(
    instance,
) -> None:
    """200 replicas that reported and went (killed, scaled down, redeployed: none left): their
    reports are gone FRESH_S after their last, on the actor's clock, and the GCS holds the
    desired state alone, as it did before them."""
    from ray.experimental import internal_kv

    live = _registry(instance)
    live.start(["m/1"])
    gcs_before = sorted(internal_kv._internal_kv_list(instance, namespace=registry_actor.NAMESPACE))
    gone = _registry(instance)
    for number in range(200):
        await asyncio.to_thread(gone.report, "Inference", f"gone-{number}", ["m/1"])
    await until(lambda: len(live.reports("Inference")) == 200, 10)
    started = time.monotonic()
    while len(live.reports("Inference")) != 1:
        await asyncio.to_thread(live.report, "Inference", "live", ["m/1"])
        assert time.monotonic() - started < FRESH_S + 5
        await asyncio.sleep(0.25)  # pacing: live's reports go on
    assert [report.replica for report in live.reports("Inference")] == ["live"]
    assert live.desired() == {"m/1": "serve"}
    gcs_after = sorted(internal_kv._internal_kv_list(instance, namespace=registry_actor.NAMESPACE))
    assert gcs_after == gcs_before and gcs_after  # the desired state's keys, nothing more


async def test_a_renewal_that_changes_nothing_is_answered_without_the_store(instance) -> None:
    """A heartbeat's answer is the store only where something changed or the writer's copy
    is behind: 200 replicas renewing each second do not move 200 stores a second."""
    import ray

    first, second = _registry(instance), _registry(instance)
    first.start(["m/1"])
    second.start(["m/1"])
    store = _stores[instance][0]
    actor = ray.get_actor(actor_name(instance), namespace=registry_actor.NAMESPACE)
    key, value = f"{instance}/report/Inference/r1", b'{"holds": ["m/1"], "failed": {}}'
    added, snapshot = ray.get(actor.put.remote(key, value, True, store._known()))
    assert added and snapshot is not None  # a change: the store comes back
    store._adopt(snapshot)
    added, snapshot = ray.get(actor.put.remote(key, value, True, store._known()))
    assert not added and snapshot is None  # renewed, unchanged, the copy current
    stale = (store._known()[0], store._known()[1] - 1)
    assert ray.get(actor.put.remote(key, value, True, stale))[1] is not None  # a copy behind
    known = store._known()
    second.report("Inference", "r2", ["m/1"])  # another replica's change meanwhile
    assert ray.get(actor.put.remote(key, value, True, known))[1] is not None
    await until(lambda: "r2" in {r.replica for r in first.reports("Inference")}, 5)
