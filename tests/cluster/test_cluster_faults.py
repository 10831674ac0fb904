"""Stage links and the model registry under faults on a multi-node Ray cluster (`make
test-cluster`): a head (the ingress), node a (Preprocess, Postprocess), node b and node d
(one Inference replica each), node d's Python processes seeing a clock 60 s ahead. A steady
stream goes on while node b's Inference replica is frozen (SIGSTOP), and again while it is
cut off the network (every packet of its stage port dropped); node d's replica reports and
serves; 200 replica reports start and stop; the registry comes back to the live replicas.
Inference runs the echo engine (20 ms a batch): the latencies are the link's.

The tests share one cluster and run in file order."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from loopback_cluster import (
    APP,
    HOST,
    LoopbackCluster,
    PortCut,
    deploy_raystream,
    in_private_network,
    wait_for,
)

from serve_app.models.registry import FRESH_S
from serve_app.tuning import BEAT_S, CONNECT_TIMEOUT_S, SILENT_S

from conftest import ROOT

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        not in_private_network(),
        reason="needs a network namespace of its own with only loopback: `make test-cluster`",
    ),
]

SKEW_S = 60.0
# On node d's PYTHONPATH: every Python process there, Ray's own too, sees the clock ahead.
SKEWED_CLOCK = f"""
import time

_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + {SKEW_S}
time.time_ns = lambda: _time_ns() + {int(SKEW_S * 1e9)}
"""
_spec = importlib.util.spec_from_file_location("bench_cluster", ROOT / "bench" / "cluster.py")
bench = sys.modules["bench_cluster"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
STAGES = ("Preprocess", "Inference", "Postprocess")
ROUTES = "ingress-routes"  # the ingress replicas' reports (serve_app/models/lifecycle.py)


@pytest.fixture(scope="module")
def cluster():
    with LoopbackCluster() as cluster:
        cluster.start_head(1, {"raystream_ingress": 1, "node_head": 1})
        cluster.add_node("a", 1, {"raystream_decode": 1, "node_a": 1})
        cluster.add_node("b", 1, {"raystream_inference": 1, "node_b": 1})
        skewed = cluster.root / "skewed-clock"
        skewed.mkdir()
        (skewed / "sitecustomize.py").write_text(SKEWED_CLOCK)
        path = os.pathsep.join(filter(None, [str(skewed), os.environ.get("PYTHONPATH")]))
        cluster.add_node("d", 1, {"raystream_inference": 1, "node_d": 1}, {"PYTHONPATH": path})
        yield cluster


def _deploy(cluster: LoopbackCluster, preprocess: int = 1, batch: int = 32):
    """Two Inference replicas (one a node: b and d have a CPU each) on the echo engine."""
    deployments = {
        "Inference": {
            "num_replicas": 2,
            "autoscaling_config": None,
            "user_config": {"max_batch_size": batch, "batch_wait_timeout_s": 0.0},
        },
        # a quarter CPU each: two fit node a's one CPU beside Postprocess
        "Preprocess": {
            "num_replicas": preprocess,
            "ray_actor_options": {"num_cpus": 0.25, "resources": {"raystream_decode": 0.01}},
        },
    }
    return deploy_raystream(cluster, ROOT / "models", deployments, bench.echo_engine(20))


@pytest.fixture(scope="module")
def deployed(cluster):
    return _deploy(cluster)


def _driver(cluster: LoopbackCluster, code: str) -> object:
    """Runs `code` in a Ray driver of its own (functions of _REGISTRY at hand); the JSON it
    prints last."""
    script = f"import json, os, time, ray\nray.init(address={cluster.address!r})\n{_REGISTRY}\n"
    done = subprocess.run(
        [sys.executable, "-c", script + code],
        env=cluster.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if not line.startswith("\x1b")]
    return json.loads(lines[-1])  # Ray's own lines to the driver start with a colour


_REGISTRY = '''
from ray.experimental import internal_kv
from ray.util import list_named_actors

def registries():
    return [ray.get_actor(a["name"], namespace="raystream")
            for a in list_named_actors(all_namespaces=True)
            if a["namespace"] == "raystream" and a["name"].startswith("raystream-registry-")]

def store():
    """Every registry actor's keys and values, as one dict."""
    found = {}
    for actor in registries():
        found.update({k: v.decode() for k, v in ray.get(actor.snapshot.remote())[2].items()})
    return found

def reports(deployment):
    """replica -> its report, for `deployment`."""
    return {k.rsplit("/", 1)[1]: json.loads(v) for k, v in store().items()
            if "/report/" + deployment + "/" in k}

def gcs_keys():
    return sorted(k.decode() for k in internal_kv._internal_kv_list("", namespace="raystream"))
'''


def _replicas(cluster: LoopbackCluster, deployment: str) -> list[dict]:
    return cluster.replicas(APP, deployment)


def _stage_calls(cluster: LoopbackCluster, node: str) -> dict[str, float]:
    """raystream_stage_calls_total to Inference over ports from node `node`'s replicas, by
    outcome (Ray's metrics on the node's export port)."""
    port = 21100 + cluster.nodes[node].index
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        wanted = ("raystream_stage_calls_total{", 'callee="Inference"', 'transport="port"')
        if all(part in line for part in wanted):
            outcome = re.search(r'outcome="(\w+)"', line).group(1)
            found[outcome] = found.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def _serve_log(cluster: LoopbackCluster, deployment: str) -> str:
    logs = cluster.root / "ray" / "session_latest" / "logs" / "serve"
    return "".join(p.read_text() for p in logs.glob(f"replica_{APP}_{deployment}_*.log"))


def test_a_frozen_replica_costs_a_call_at_most_the_silence_limit(cluster, deployed) -> None:
    """Node b's Inference replica frozen (SIGSTOP) for 10 s mid-stream: its host still takes
    TCP, the process answers nothing. Every request is answered once, OK; none waits more
    than the link's silence limit (SILENT_S + BEAT_S / 2) over the stream's normal latency;
    the frozen address costs only the calls that were on it: then it is probed by a connect
    with backoff, no call waits on it again."""
    (frozen,) = [r for r in _replicas(cluster, "Inference") if cluster.node_of(r["node_id"]) == "b"]
    address = _driver(
        cluster, f"print(json.dumps(reports('Inference')[{frozen['replica_id']!r}]))"
    )["address"]
    before = _stage_calls(cluster, "a")
    events = (
        bench.Event(0, "stream", lambda: 0),
        bench.Event(6, "frozen", lambda: os.kill(frozen["pid"], signal.SIGSTOP) or 0),
        bench.Event(16, "thawed", lambda: os.kill(frozen["pid"], signal.SIGCONT) or 0),
    )
    try:
        report = bench.measure(cluster, deployed, [bench.Phase("stream", 24, 10)], events=events)
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    whole = report["headline"]["stream"]["latency_next_40s"]
    normal = max(r["p99_ms"] or 0 for r in report["per_second"] if r["t"] < 6)
    print("through the freeze:", whole, "normal p99 before:", normal)  # pytest -s
    assert report["exactly_once"] and set(report["requests"]["codes"]) == {"OK"}, report
    assert whole["max_ms"] <= normal + 1000 * (SILENT_S + BEAT_S / 2) + 500, whole
    log = _serve_log(cluster, "Preprocess")
    failures = log.count(f"the stage port {address} failed")
    assert f"the stage port {address} sent nothing" in log
    # Ray exports the counters every few seconds; the failures came 15 s before the end
    after = wait_for(
        lambda: (c := _stage_calls(cluster, "a")).get("link_down", 0) > 0 and c,
        60,
        what="the stage call metrics",
    )
    lost = after["link_down"] - before.get("link_down", 0)
    print("failures of the frozen address:", failures, "calls link_down:", lost)
    assert 1 <= lost <= 3, (lost, after)  # the calls on the link when it froze, no more


def test_a_replica_cut_off_the_network_costs_a_call_at_most_the_connect_timeout(
    cluster, deployed
) -> None:
    """Node b's Inference replica cut off for 10 s mid-stream: every packet to or from its
    stage port dropped (the process runs on). Every request is answered once, OK; none waits
    more than the connect timeout over the stream's normal latency (the link on the port goes
    silent, a new connect gets no answer); the link notices the silence."""
    (cut,) = [r for r in _replicas(cluster, "Inference") if cluster.node_of(r["node_id"]) == "b"]
    reported = _driver(cluster, f"print(json.dumps(reports('Inference')[{cut['replica_id']!r}]))")
    address = reported["address"]
    # (the replica frozen by the test before takes calls again: the silence below says so)
    silences = _serve_log(cluster, "Preprocess").count(f"the stage port {address} sent nothing")
    port = PortCut(int(address.rsplit(":", 1)[1]))
    events = (
        bench.Event(0, "stream", lambda: 0),
        bench.Event(6, "cut", lambda: port.on() or 0),
        bench.Event(16, "joined", lambda: port.off() or 0),
    )
    try:
        report = bench.measure(cluster, deployed, [bench.Phase("stream", 24, 10)], events=events)
    finally:
        port.off()
    whole = report["headline"]["stream"]["latency_next_40s"]
    normal = max(r["p99_ms"] or 0 for r in report["per_second"] if r["t"] < 6)
    print("through the cut:", whole, "normal p99 before:", normal)  # pytest -s
    assert report["exactly_once"] and set(report["requests"]["codes"]) == {"OK"}, report
    assert whole["max_ms"] <= normal + 1000 * CONNECT_TIMEOUT_S + 500, whole
    log = _serve_log(cluster, "Preprocess")
    assert log.count(f"the stage port {address} sent nothing") > silences


def test_a_node_whose_clock_is_60_s_ahead_serves_and_its_replica_expires_in_time(
    cluster, deployed, photos
) -> None:
    """Node d's processes see time.time() 60 s ahead (Ray starts there all the same). Its
    Inference replica's report stays fresh and takes the calls (node b's replica, the only
    other one, frozen meanwhile); SIGKILLed, its report is gone within FRESH_S of the
    registry's own clock plus a heartbeat and the expiry tick, not 60 s early or late."""
    ahead = _driver(
        cluster,
        "task = ray.remote(num_cpus=0, resources={'node_d': 0.001})(lambda: time.time())\n"
        "print(json.dumps([ray.get(task.remote()), time.time()]))",
    )
    assert ahead[0] - ahead[1] == pytest.approx(SKEW_S, abs=5), ahead
    (skewed,) = [r for r in _replicas(cluster, "Inference") if cluster.node_of(r["node_id"]) == "d"]
    (other,) = [r for r in _replicas(cluster, "Inference") if r is not skewed and r != skewed]
    seen = _driver(  # fresh for 8 s in a row: renewed, not dropped as 60 s old
        cluster,
        f"rid = {skewed['replica_id']!r}\n"
        "seen = []\n"
        "for _ in range(16):\n"
        "    seen.append(rid in reports('Inference'))\n"
        "    time.sleep(0.5)  # sampling: a report seen each time\n"
        "print(json.dumps(seen))",
    )
    assert all(seen), seen
    os.kill(other["pid"], signal.SIGSTOP)  # every Inference call must go to node d
    try:
        report = bench.measure(cluster, deployed, [bench.Phase("stream", 8, 10)])
    finally:
        os.kill(other["pid"], signal.SIGCONT)
    assert report["exactly_once"] and set(report["requests"]["codes"]) == {"OK"}, report
    gone = _driver(
        cluster,
        f"rid, pid = {skewed['replica_id']!r}, {skewed['pid']}\n"
        "assert rid in reports('Inference')\n"
        "killed = time.monotonic()\n"
        "os.kill(pid, 9)\n"
        "while rid in reports('Inference'):\n"
        "    time.sleep(0.1)  # polling\n"
        "print(json.dumps(time.monotonic() - killed))",
    )
    print("the skewed replica's report went", gone, "s after its SIGKILL")
    # FRESH_S after its last renewal (up to a heartbeat before the kill), + the expiry tick
    assert FRESH_S - 1.5 <= gone <= FRESH_S + 0.5 + 1.0, gone
    cluster.wait_running(APP)  # Serve starts another on node d


CHURN = '''
import signal, threading, uuid
from serve_app.models.registry import ModelRegistry
from serve_app.models.registry_actor import ActorStore

@ray.remote(num_cpus=0)
class Replicas:
    """`n` replicas' reports from one process, each as a stage replica makes it (the same
    ModelRegistry, a report every 0.25 s, renewed once a second), over the process' one
    ActorStore, as a replica's process has one."""

    def start(self, instance, n):
        self.names = [f"churn-{uuid.uuid4().hex[:8]}" for _ in range(n)]
        store = ActorStore(instance)
        self.registries = [ModelRegistry(store, instance) for _ in range(n)]
        threading.Thread(target=self._report, daemon=True).start()
        reported = lambda: {r.replica for r in self.registries[0].reports("Inference")}
        while not set(self.names) <= reported():
            time.sleep(0.05)  # polling: every client has reported once
        return self.names

    def _report(self):
        while True:
            for name, registry in zip(self.names, self.registries):
                registry.report("Inference", name, ["churn/1"], address=f"127.0.0.1:{1}")
            time.sleep(0.25)  # pacing: a report every 0.25 s

    def end(self, how):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        for name, registry in zip(self.names, self.registries):
            registry.leave("Inference", name)
        ray.actor.exit_actor()
'''


def test_after_200_replica_starts_and_stops_the_registry_holds_the_live_replicas(
    cluster, deployed
) -> None:
    """Real replicas stopped and started (an Inference replica killed, Preprocess scaled up
    and down, a redeploy with a new user_config) and 200 registry clients that report as
    replicas do, in processes on every node, then SIGKILLed or leaving: within 30 s the
    registry holds the reports of the live replicas alone and the desired state as it was,
    and the GCS holds no more keys than before. In steady state the registry actor takes at
    most about one call a second from each replica."""
    before = _driver(cluster, "print(json.dumps([store(), gcs_keys()]))")
    desired = {k: v for k, v in before[0].items() if "/desired/" in k}
    assert desired, before
    instance = next(iter(desired)).split("/", 1)[0]
    starts = _driver(
        cluster,
        CHURN + f"instance = {instance!r}\n"
        "nodes = ['node_head', 'node_a', 'node_b', 'node_d']\n"
        "started = 0\n"
        "for wave in range(2):\n"
        "    group = [Replicas.options(resources={nodes[i % 4]: 0.001}).remote()\n"
        "             for i in range(5)]\n"
        "    names = ray.get([g.start.remote(instance, 20) for g in group])\n"
        "    started += sum(map(len, names))\n"
        "    assert all(n in reports('Inference') for ns in names for n in ns)\n"
        "    for i, g in enumerate(group):\n"
        "        g.end.remote('kill' if i % 2 else 'leave')\n"
        "print(json.dumps(started))",
    )
    assert starts == 200
    (victim,) = [r for r in _replicas(cluster, "Inference") if cluster.node_of(r["node_id"]) == "b"]
    _driver(cluster, f"ray.kill(ray.get_actor({victim['actor_name']!r}, namespace='serve'))\n"
            "print(1)")  # fmt: skip
    _deploy(cluster, preprocess=2, batch=16)  # one more Preprocess, Inference reconfigured
    _deploy(cluster, preprocess=1, batch=32)
    began = time.monotonic()

    def settled() -> dict | None:
        live = {d: {r["replica_id"] for r in _replicas(cluster, d)} for d in (*STAGES, "Ingress")}
        now = _driver(
            cluster,
            "print(json.dumps({d: sorted(reports(d)) for d in "
            f"{[*STAGES, ROUTES]!r}}} | {{'keys': gcs_keys(), 'store': store()}}))",
        )
        reported = {d: set(now[d]) for d in STAGES} | {"Ingress": set(now[ROUTES])}
        return now if reported == live and len(live["Preprocess"]) == 1 else None

    now = wait_for(settled, 60, every=1.0, what="the registry holding the live replicas")
    took = time.monotonic() - began
    print("the registry held the live replicas alone", round(took, 1), "s after the last deploy")
    assert took <= 30, took
    assert {k: v for k, v in now["store"].items() if "/desired/" in k} == desired
    assert len(now["keys"]) <= len(before[1]), (now["keys"], before[1])
    calls = _driver(
        cluster,
        f"actor = ray.get_actor('raystream-registry-{instance}', namespace='raystream')\n"
        "first = ray.get(actor.calls.remote())\n"
        "time.sleep(10)  # the window the calls are counted over\n"
        "last = ray.get(actor.calls.remote())\n"
        "print(json.dumps({k: last[k] - first.get(k, 0) for k in last}))",
    )
    replicas = sum(len(now[d]) for d in (*STAGES, ROUTES))
    per_replica_s = (sum(calls.values()) - 2) / 10 / replicas  # less the two calls() calls
    print("registry actor calls in 10 s of steady state:", calls, "replicas:", replicas)
    assert per_replica_s <= 1.2, (calls, replicas)
