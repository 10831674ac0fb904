"""raystream on a multi-node Ray cluster, seen by a plain grpcio client: autoscaling under a
load step, and a stream that loses worker nodes and the Serve controller.

    python bench/cluster.py autoscale [--step-rate 70] [--echo-delay-ms 40 --max-batch-size 2]
    python bench/cluster.py faults [--rate 10]

Both start a head and worker nodes with `ray start` (tests/cluster/loopback_cluster.py: every
node on 127.0.0.1, in a network namespace of its own, which this script enters by itself) and
deploy deploy/serve_config.cluster.yaml on them with `serve deploy`: the ingress on the head,
Preprocess and Postprocess on node a, Inference on node b. The load is open loop (Poisson
arrivals) over --connections TLS connections with the token, one `Classify` stream each,
requests of --images of the seven built-in photos; Serve's replicas are polled once a second.

autoscale: Inference autoscaled from 1 to --max-replicas, with shorter delays than the file's
so that a run takes minutes; --base-rate img/s, then --step-rate for --step-s seconds, then
--base-rate again for --after-s seconds. With --echo-delay-ms, Inference runs no model: each
batch of at most --max-batch-size images takes that long, so a replica's capacity is bounded
by time, as a GPU replica's is, rather than by the host's cores (on a 2-core host a second
ONNX Runtime replica adds no capacity: the cores are already busy).

faults: a spare worker node (c) that can run every stage joins; a stream at --rate img/s;
node a's raylet is SIGKILLed at --kill-a-s, node b's at --kill-b-s, and the Serve controller's
process at --kill-controller-s.

Writes cluster_<scenario>.json (every second: images sent and answered OK, latency p50/p99 by
answer time, replicas by deployment and state; the requests' status codes and the
exactly-one-answer check; the headline figures) and cluster_<scenario>.png to --out (default
bench/results/cluster-<time>, or $OUT/bench when OUT is set).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests"), str(ROOT / "tests" / "cluster")]

import load  # noqa: E402  (bench/load.py: the photos and the request encoding)
import loopback_cluster as lc  # noqa: E402
from load import pb  # noqa: E402

INFERENCE = "Inference"


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    images_per_s: float


@dataclass(frozen=True)
class Event:
    """`action()` run `at` seconds into the load; its result goes into the report."""

    at: float
    name: str
    action: Callable[[], object]


@dataclass
class Outcome:
    """One request: when it was sent and answered (Unix seconds), its status code."""

    sent: float
    answered: float | None = None
    code: int | None = None
    message: str = ""
    images_ok: int = 0


@dataclass
class StepLoad:
    """An open-loop load in phases over `connections` TLS connections, one Classify stream
    each; every request is recorded with its answer (or its absence)."""

    deployed: lc.Deployed
    phases: list[Phase]
    connections: int = 2
    images: int = 2
    seed: int = 0
    drain_s: float = 120.0
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    duplicates: int = 0
    unknown: int = 0
    stream_errors: collections.Counter = field(default_factory=collections.Counter)
    start: float = 0.0

    def _channel(self, connection: int) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(self.deployed.root_certificate)
        options = [
            ("grpc.use_local_subchannel_pool", 1),
            ("raystream.bench.connection", connection),  # a TCP connection of its own
        ]
        return grpc.aio.secure_channel(self.deployed.target, credentials, options=options)

    async def run(self, photos: list[bytes], start: float) -> None:
        spec = load.LoadSpec(target=self.deployed.target, images=self.images)
        channels = [self._channel(c) for c in range(self.connections)]
        try:
            ready = asyncio.gather(*(ch.channel_ready() for ch in channels))
            await asyncio.wait_for(ready, 60)
            self.start = start
            await asyncio.gather(
                *(
                    self._stream(ch, load._Requests(spec, photos, c), random.Random(self.seed + c))
                    for c, ch in enumerate(channels)
                )
            )
        finally:
            await asyncio.gather(*(ch.close() for ch in channels))

    def schedule(self) -> list[tuple[float, Phase]]:
        out, at = [], self.start
        for phase in self.phases:
            out.append((at, phase))
            at += phase.seconds
        return out

    async def _stream(self, channel, requests, rng: random.Random) -> None:
        metadata = (("authorization", f"Bearer {self.deployed.token}"),)
        call = channel.stream_stream(
            f"/{load.SERVICE}/Classify", response_deserializer=pb.ClassifyResponse.FromString
        )(metadata=metadata)

        async def write() -> None:
            try:
                for phase_start, phase in self.schedule():
                    due, end = phase_start, phase_start + phase.seconds
                    rate = phase.images_per_s / self.images / self.connections
                    while rate > 0:
                        due += rng.expovariate(rate)
                        if due >= end:
                            break
                        await asyncio.sleep(max(due - time.time(), 0))
                        rid, data = requests.next()
                        self.outcomes[rid] = Outcome(time.time())
                        await call.write(data)
                    await asyncio.sleep(max(end - time.time(), 0))
                await call.done_writing()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # the stream ended: read() records its status

        async def read() -> None:
            try:
                while (response := await call.read()) is not grpc.aio.EOF:
                    outcome = self.outcomes.get(response.request_id)
                    if outcome is None:
                        self.unknown += 1
                    elif outcome.answered is not None:
                        self.duplicates += 1
                    else:
                        outcome.answered = time.time()
                        outcome.code = response.error.code
                        outcome.message = response.error.message
                        outcome.images_ok = sum(not r.error.code for r in response.results)
            except grpc.aio.AioRpcError as exc:
                self.stream_errors[exc.code().name] += 1

        writer, reader = asyncio.create_task(write()), asyncio.create_task(read())
        end = self.start + sum(p.seconds for p in self.phases)
        try:
            await asyncio.wait_for(reader, end + self.drain_s - time.time())
        except TimeoutError:
            call.cancel()
        writer.cancel()


class ReplicaSampler(threading.Thread):
    """Serve's replicas of every deployment, by state, once per `every` seconds."""

    def __init__(self, cluster: lc.LoopbackCluster, every: float = 1.0) -> None:
        super().__init__(daemon=True, name="replica-sampler")
        self.cluster, self.every = cluster, every
        self.samples: list[dict] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            at = time.time()
            try:
                deployments = self.cluster.applications()[lc.APP]["deployments"]
            except (OSError, KeyError, ValueError):
                deployments = None  # the dashboard did not answer this time
            # While the controller restarts, Serve lists deployments without replicas
            if deployments and all(d["replicas"] for d in deployments.values()):
                counts = {
                    name: dict(collections.Counter(r["state"] for r in d["replicas"]))
                    for name, d in deployments.items()
                }
                self.samples.append({"t": at, "replicas": counts})
            self.stopping.wait(max(self.every - (time.time() - at), 0.05))

    def stop(self) -> list[dict]:
        self.stopping.set()
        self.join(10)
        return self.samples


def measure(
    cluster: lc.LoopbackCluster,
    deployed: lc.Deployed,
    phases: list[Phase],
    *,
    events: tuple[Event, ...] = (),
    connections: int = 2,
    images: int = 2,
) -> dict:
    """Runs the load, the events at their times, and the replica sampler; the report."""
    photos = load.builtin_photos()
    step = StepLoad(deployed, phases, connections=connections, images=images)
    sampler = ReplicaSampler(cluster)
    start = time.time() + 1.0
    done: list[dict] = []

    def fire(event: Event) -> None:
        try:
            result = event.action()
        except Exception as exc:  # reported, and the run goes on
            result = f"{type(exc).__name__}: {exc}"
        done.append({"name": event.name, "t": round(time.time() - start, 2), "result": result})

    timers = [threading.Timer(start + e.at - time.time(), fire, (e,)) for e in events]
    sampler.start()
    for timer in timers:
        timer.start()
    try:
        asyncio.run(step.run(photos, start))
    finally:
        for timer in timers:
            timer.cancel()
        samples = sampler.stop()
    return summarize(step, samples, done)


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(step: StepLoad, samples: list[dict], events: list[dict]) -> dict:
    """Per second: images sent and answered OK, latency p50/p99 (by answer time); replicas
    running (or recovering) per deployment and Inference's by state; the requests' codes;
    the headline."""
    t0 = step.start
    end = max([o.answered or o.sent for o in step.outcomes.values()] + [t0]) - t0
    seconds = int(end) + 1
    sent, ok_images = [0] * seconds, [0] * seconds
    latencies: list[list[float]] = [[] for _ in range(seconds)]
    for o in step.outcomes.values():
        sent[int(o.sent - t0)] += step.images
        if o.answered is not None:
            i = int(o.answered - t0)
            ok_images[i] += o.images_ok
            latencies[i].append((o.answered - o.sent) * 1000.0)
    replicas = [
        {
            "t": round(s["t"] - t0, 2),
            **{state.lower(): n for state, n in s["replicas"].get(INFERENCE, {}).items()},
            # A restarted controller lists the replicas it takes back as RECOVERING: they
            # serve meanwhile
            "running_by_deployment": {
                name: states.get("RUNNING", 0) + states.get("RECOVERING", 0)
                for name, states in s["replicas"].items()
            },
        }
        for s in samples
    ]
    codes = collections.Counter(
        "unanswered" if o.code is None else load.CODE_NAMES.get(o.code, str(o.code))
        for o in step.outcomes.values()
    )
    report = {
        "load": {
            "connections": step.connections,
            "images_per_request": step.images,
            "phases": [
                {"name": p.name, "start": round(at - t0, 2), **vars(p)} for at, p in step.schedule()
            ],
        },
        "requests": {
            "sent": len(step.outcomes),
            "answered": sum(o.answered is not None for o in step.outcomes.values()),
            "duplicates": step.duplicates,
            "unknown": step.unknown,
            "codes": dict(codes),
            "messages": dict(
                collections.Counter(o.message[:160] for o in step.outcomes.values() if o.code)
            ),
            "stream_errors": dict(step.stream_errors),
        },
        "events": events,
        "per_second": [
            {
                "t": i,
                "images_sent": sent[i],
                "images_ok": ok_images[i],
                "p50_ms": _percentile(latencies[i], 50),
                "p99_ms": _percentile(latencies[i], 99),
            }
            for i in range(seconds)
        ],
        "replicas": replicas,
    }
    report["exactly_once"] = (
        report["requests"]["sent"] == report["requests"]["answered"]
        and step.duplicates == step.unknown == 0
    )
    outcomes = list(step.outcomes.values())
    report["headline"] = (
        _scaling(report, outcomes, t0)
        if any(p.name == "step" for p in step.phases)
        else _outages(events, outcomes, t0)
    )
    return report


def latency(outcomes: list[Outcome], t0: float, since: float, until: float) -> dict:
    """Latency of the requests sent between `since` and `until` (seconds from t0) and
    answered OK."""
    values = [
        (o.answered - o.sent) * 1000.0
        for o in outcomes
        if o.answered is not None and o.code == 0 and since <= o.sent - t0 < until
    ]
    return {
        "p50_ms": _percentile(values, 50),
        "p99_ms": _percentile(values, 99),
        "max_ms": max(values, default=None),
        "requests": len(values),
    }


def _scaling(report: dict, outcomes: list[Outcome], t0: float) -> dict:
    """When Inference's replicas went up and down around the step, and the latency before,
    until the scale-up, over the last 20 s of the step and after it."""
    step = next(p for p in report["load"]["phases"] if p["name"] == "step")
    step_start, step_end = step["start"], step["start"] + step["seconds"]
    running = [(r["t"], r.get("running", 0)) for r in report["replicas"]]
    base = min((n for t, n in running if t < step_start), default=None)
    peak = max((n for _, n in running), default=None)
    up_at = next((t for t, n in running if t >= step_start and n > (base or 0)), None)
    down_at = next((t for t, n in running if t >= step_end and n == base), None)
    return {
        "replicas_before": base,
        "replicas_peak": peak,
        "scaled_up_after_s": None if up_at is None else round(up_at - step_start, 1),
        "scaled_down_after_s": (
            None if down_at is None or peak == base else round(down_at - step_end, 1)
        ),
        "latency_before_step": latency(outcomes, t0, 0, step_start),
        "latency_step_until_scale_up": latency(outcomes, t0, step_start, up_at or step_end),
        "latency_last_20s_of_step": latency(outcomes, t0, step_end - 20, step_end),
        "latency_after_step": latency(outcomes, t0, step_end, float("inf")),
    }


def _outages(events: list[dict], outcomes: list[Outcome], t0: float) -> dict:
    """Per event: the requests sent in the 40 s after it (their codes, the longest wait for
    an OK answer) and when the first request sent after it was answered OK."""
    out = {}
    for event in events:
        at = event["t"]
        after = [o for o in outcomes if at <= o.sent - t0 < at + 40]
        first_ok = min((o.answered - t0 for o in after if o.code == 0), default=None)
        out[event["name"]] = {
            "at_s": at,
            "codes": dict(collections.Counter(o.code for o in after)),
            "first_ok_answer_after_s": None if first_ok is None else round(first_ok - at, 1),
            "latency_next_40s": latency(outcomes, t0, at, at + 40),
        }
    return out


def plot(report: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["per_second"]
    t = [r["t"] for r in rows]
    fig, (rate, lat, reps) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    rate.plot(t, [r["images_sent"] for r in rows], label="images sent /s", lw=1)
    rate.plot(t, [r["images_ok"] for r in rows], label="images answered OK /s", lw=1)
    rate.set_ylabel("img/s")
    lat.plot(t, [r["p50_ms"] for r in rows], label="p50", lw=1)
    lat.plot(t, [r["p99_ms"] for r in rows], label="p99", lw=1)
    lat.set_yscale("log")
    lat.set_ylabel("latency ms (by answer time)")
    samples = report["replicas"]
    times = [s["t"] for s in samples]
    if any(p["name"] == "step" for p in report["load"]["phases"]):
        for state in ("running", "starting", "stopping"):
            counts = [s.get(state, 0) for s in samples]
            reps.step(times, counts, where="post", label=f"Inference {state}")
    else:
        names = sorted({n for s in samples for n in s["running_by_deployment"]})
        for i, name in enumerate(names):
            counts = [s["running_by_deployment"].get(name, 0) + i * 0.04 for s in samples]
            reps.step(times, counts, where="post", label=f"{name} running or recovering")
    reps.set_ylabel("replicas")
    reps.set_xlabel("seconds")
    for axis in (rate, lat, reps):
        axis.legend(loc="upper right", fontsize="small")
        for p in report["load"]["phases"][1:]:
            axis.axvline(p["start"], color="grey", ls=":", lw=1)
        for e in report["events"]:
            axis.axvline(e["t"], color="red", ls="--", lw=1)
    for e in report["events"]:
        rate.annotate(e["name"], (e["t"], rate.get_ylim()[1]), fontsize="small", va="top")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- scenarios --------------------------------------------------------------------------------


def autoscaling(max_replicas: int, upscale_s: float, downscale_s: float) -> dict:
    """Inference's autoscaling for a run that takes minutes: the file's policy, shorter."""
    import yaml

    config = yaml.safe_load(lc.CLUSTER_CONFIG.read_text())
    deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}
    policy = dict(deployments[INFERENCE]["autoscaling_config"])
    policy.update(
        max_replicas=max_replicas,
        upscale_delay_s=upscale_s,
        downscale_delay_s=downscale_s,
        look_back_period_s=5,
        metrics_interval_s=1,
    )
    return {INFERENCE: {"autoscaling_config": policy}}


def echo_engine(delay_ms: float) -> dict:
    """Application args for an Inference with no model: each batch takes `delay_ms`."""
    return {"engine": {"kind": "echo", "options": {"delay_ms": delay_ms}}}


def run_autoscale(cluster: lc.LoopbackCluster, args: argparse.Namespace) -> tuple[dict, str]:
    lc.start_three_nodes(cluster)
    deployments = autoscaling(args.max_replicas, args.upscale_delay_s, args.downscale_delay_s)
    if args.max_batch_size:
        deployments[INFERENCE]["user_config"] = {"max_batch_size": args.max_batch_size}
    app_args = echo_engine(args.echo_delay_ms) if args.echo_delay_ms is not None else {}
    deployed = lc.deploy_raystream(cluster, ROOT / "models", deployments, app_args)
    phases = [
        Phase("base", args.base_s, args.base_rate),
        Phase("step", args.step_s, args.step_rate),
        Phase("after", args.after_s, args.base_rate),
    ]
    report = measure(cluster, deployed, phases, connections=args.connections, images=args.images)
    head = report["headline"]
    engine = f"echo {args.echo_delay_ms:g} ms/batch" if app_args else "ONNX Runtime"
    title = (
        f"{engine}, step {args.step_rate:g} img/s: Inference {head['replicas_before']} -> "
        f"{head['replicas_peak']} replicas {head['scaled_up_after_s']} s into the step, "
        f"back down {head['scaled_down_after_s']} s after it"
    )
    return report, title


def kill_controller(cluster: lc.LoopbackCluster) -> int:
    """SIGKILL the Serve controller's process (Ray restarts the actor); its pid."""
    pids = [p for p in lc.namespace_processes() if lc.comm(p).startswith("ray::ServeCont")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one Serve controller process, found {pids}")
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def fault_events(cluster: lc.LoopbackCluster, kill_a: float, kill_b: float, kill_ctl: float):
    return (
        Event(kill_a, "node a lost", lambda: cluster.kill_raylet("a")),
        Event(kill_b, "node b lost", lambda: cluster.kill_raylet("b")),
        Event(kill_ctl, "controller killed", lambda: kill_controller(cluster)),
    )


def run_faults(cluster: lc.LoopbackCluster, args: argparse.Namespace) -> tuple[dict, str]:
    lc.start_three_nodes(cluster)
    deployed = lc.deploy_raystream(cluster, ROOT / "models")
    lc.add_spare_node(cluster)
    report = measure(
        cluster,
        deployed,
        [Phase("stream", args.seconds, args.rate)],
        events=fault_events(cluster, args.kill_a_s, args.kill_b_s, args.kill_controller_s),
        connections=args.connections,
        images=args.images,
    )
    codes = report["requests"]["codes"]
    return (
        report,
        f"{args.rate:g} img/s, two worker nodes and the controller lost: {codes}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    scenarios = parser.add_subparsers(dest="scenario", required=True)
    scale = scenarios.add_parser("autoscale", help="a load step against autoscaled Inference")
    scale.add_argument("--base-rate", type=float, default=4.0, help="img/s before and after")
    scale.add_argument("--step-rate", type=float, default=70.0, help="img/s during the step")
    scale.add_argument("--base-s", type=float, default=20.0)
    scale.add_argument("--step-s", type=float, default=90.0)
    scale.add_argument("--after-s", type=float, default=90.0)
    scale.add_argument("--max-replicas", type=int, default=2)
    scale.add_argument("--upscale-delay-s", type=float, default=5.0)
    scale.add_argument("--downscale-delay-s", type=float, default=20.0)
    scale.add_argument(
        "--echo-delay-ms",
        type=float,
        help="no model: the echo engine, each batch taking this long (a replica whose "
        "capacity is bounded by time, as a GPU's is, not by the host's cores)",
    )
    scale.add_argument("--max-batch-size", type=int, help="Inference's batching user_config")
    faults = scenarios.add_parser("faults", help="worker nodes and the controller lost")
    faults.add_argument("--rate", type=float, default=10.0, help="img/s")
    faults.add_argument("--seconds", type=float, default=110.0)
    faults.add_argument("--kill-a-s", type=float, default=15.0)
    faults.add_argument("--kill-b-s", type=float, default=55.0)
    faults.add_argument("--kill-controller-s", type=float, default=90.0)
    for sub in (scale, faults):
        sub.add_argument("--connections", type=int, default=2)
        sub.add_argument("--images", type=int, default=2, help="photos per request")
        sub.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not lc.in_private_network():
        # A network namespace of its own, where every Ray node is at 127.0.0.1
        sys.exit(lc.run_isolated([sys.executable, *sys.argv]))
    base = Path(os.environ["OUT"]) / "bench" if os.environ.get("OUT") else HERE / "results"
    out = args.out or base / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    with lc.LoopbackCluster(keep_logs=out / "logs") as cluster:
        run = run_autoscale if args.scenario == "autoscale" else run_faults
        report, title = run(cluster, args)
    report["settings"] = {k: str(v) for k, v in vars(args).items()}
    name = f"cluster_{args.scenario}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{name}.png", title)
    print(json.dumps(report["headline"], indent=1))
    print(
        f"{title}\nrequests {report['requests']}\nexactly one answer each: "
        f"{report['exactly_once']}; written to {out}"
    )
    sys.exit(0 if report["exactly_once"] else 1)


if __name__ == "__main__":
    main()
