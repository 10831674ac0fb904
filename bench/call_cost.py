"""What one call between two Ray processes costs, with no work on either side: a Serve
deployment calling another through a DeploymentHandle (by value over Serve's gRPC transport,
and through Ray's object store, as calls without `stage_ports` go), against a plain Ray actor
calling another, and against the two Serve replicas calling over a port of the callee's own:
raystream's framed link (serve_app/transport/call_link.py, as calls with `stage_ports` go) and a
grpc.aio
unary method (raw bytes). For each: calls/s with `--in-flight` calls outstanding, each call's
latency, and the CPU of the calling and the called process per call (every thread, from
/proc).

    python bench/call_cost.py [--seconds 5] [--in-flight 4] [--payload-kb 1,1024]

The callee answers with its argument's length; the caller sends `payload` bytes a call.
Everything runs in a local Ray started here (the machine's cores, loopback only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import grpc
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import run  # bench/run.py (this script's folder): how it reads a process' CPU

from clients.local_ray import loopback_env
from serve_app.transport.call_link import Link, LinkServer

MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
]
TOKEN = b"call cost"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of `pid`."""
    return run._proc_stat(str(pid))[2] / run.TICK


async def drive(call, payload: bytes, in_flight: int, seconds: float) -> dict:
    """`in_flight` loops, each awaiting one call after another, for `seconds`."""
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < stop:
            start = time.perf_counter()
            size = await call(payload)
            assert size == len(payload)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(in_flight)))
    elapsed = time.perf_counter() - start
    return {
        "calls": len(latencies),
        "seconds": elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
    }


ECHO_METHOD = "/callcost.Echo/Echo"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class Callee:
    """Answers handle calls, and the same over a link server and a grpc.aio server of its
    own (raw bytes, no protobuf)."""

    async def __init__(self) -> None:
        async def echo(payload: bytes, context) -> bytes:
            return str(len(payload)).encode()

        handler = grpc.method_handlers_generic_handler(
            "callcost.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        )
        self._server = grpc.aio.server(options=MESSAGE_OPTIONS)
        self._server.add_generic_rpc_handlers((handler,))
        self._port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

        async def answer(payload: bytes, images: int) -> bytes:
            return str(len(payload)).encode()

        self._link_server = LinkServer(answer, TOKEN)
        self._link_port = await self._link_server.start("127.0.0.1")

    async def __call__(self, payload: bytes) -> int:
        return len(payload)

    def pid(self) -> int:
        return os.getpid()

    def port(self) -> int:
        return self._port

    def link_port(self) -> int:
        return self._link_port


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class Caller:
    def __init__(self, callee) -> None:
        self._callee = callee

    def pid(self) -> int:
        return os.getpid()

    async def callee_pid(self) -> int:
        return await self._callee.pid.remote()

    async def run(self, by_value: bool, kb: int, in_flight: int, seconds: float) -> dict:
        handle = self._callee.options(_by_reference=not by_value)
        return await drive(lambda p: handle.remote(p), b"x" * (kb * 1024), in_flight, seconds)

    async def run_grpc(self, kb: int, in_flight: int, seconds: float) -> dict:
        """The same calls over one grpc.aio channel to the callee's own port."""
        port = await self._callee.port.remote()
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address, options=MESSAGE_OPTIONS) as channel:
            echo = channel.unary_unary(ECHO_METHOD)

            async def call(payload: bytes) -> int:
                return int(await echo(payload))

            return await drive(call, b"x" * (kb * 1024), in_flight, seconds)

    async def run_link(self, kb: int, in_flight: int, seconds: float) -> dict:
        """The same calls over one framed link to the callee's own port."""
        link = Link(f"127.0.0.1:{await self._callee.link_port.remote()}", TOKEN)

        async def call(payload: bytes) -> int:
            return int(await link.call(payload))

        try:
            return await drive(call, b"x" * (kb * 1024), in_flight, seconds)
        finally:
            await link.close()


@ray.remote(num_cpus=0)
class ActorCallee:
    async def echo(self, payload: bytes) -> int:
        return len(payload)

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class ActorCaller:
    def __init__(self, callee) -> None:
        self._callee = callee

    def pid(self) -> int:
        return os.getpid()

    async def run(self, kb: int, in_flight: int, seconds: float) -> dict:
        async def call(payload: bytes) -> int:
            return await self._callee.echo.remote(payload)

        return await drive(call, b"x" * (kb * 1024), in_flight, seconds)


def measured(run, caller_pid: int, callee_pid: int) -> dict:
    before = cpu_s(caller_pid), cpu_s(callee_pid)
    result = run()
    caller, callee = cpu_s(caller_pid) - before[0], cpu_s(callee_pid) - before[1]
    calls = result["calls"]
    return {
        **result,
        "calls_per_s": calls / result["seconds"],
        "caller_cpu_ms": 1000 * caller / calls,
        "callee_cpu_ms": 1000 * callee / calls,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--payload-kb", default="1,1024", help="payload sizes, comma-separated")
    args = parser.parse_args()
    os.environ.update(loopback_env())
    os.environ.setdefault("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", str(1 << 30))
    ray.init(logging_level="ERROR", log_to_driver=False)
    serve.start(proxy_location="Disabled")
    serve_caller = serve.run(Caller.bind(Callee.bind()), name="call-cost", route_prefix=None)
    serve_pids = serve_caller.pid.remote().result(), serve_caller.callee_pid.remote().result()
    actor_callee = ActorCallee.remote()
    actor_caller = ActorCaller.remote(actor_callee)
    actor_pids = ray.get(actor_caller.pid.remote()), ray.get(actor_callee.pid.remote())

    rows = []
    for kb in [int(k) for k in args.payload_kb.split(",")]:
        for name, by_value in (("serve, by value", True), ("serve, object store", False)):
            serve_caller.run.remote(by_value, kb, args.in_flight, 0.5).result()  # warm-up
            result = measured(
                lambda b=by_value, kb=kb: serve_caller.run.remote(
                    b, kb, args.in_flight, args.seconds
                ).result(),
                *serve_pids,
            )
            rows.append((name, kb, result))
        for name, method in (
            ("link port", serve_caller.run_link),
            ("grpc.aio port", serve_caller.run_grpc),
        ):
            method.remote(kb, args.in_flight, 0.5).result()  # warm-up
            result = measured(
                lambda kb=kb, m=method: m.remote(kb, args.in_flight, args.seconds).result(),
                *serve_pids,
            )
            rows.append((name, kb, result))
        ray.get(actor_caller.run.remote(kb, args.in_flight, 0.5))  # warm-up
        result = measured(
            lambda kb=kb: ray.get(actor_caller.run.remote(kb, args.in_flight, args.seconds)),
            *actor_pids,
        )
        rows.append(("ray actor", kb, result))
    print(f"\n{args.in_flight} calls in flight, {args.seconds:g} s each, {os.cpu_count()} cores")
    print(
        f"{'path':<20} {'payload':>8} {'calls/s':>8} {'p50 ms':>7} {'caller CPU ms':>14} "
        f"{'callee CPU ms':>14}"
    )
    for name, kb, r in rows:
        print(
            f"{name:<20} {kb:>6}KB {r['calls_per_s']:>8.0f} {r['p50_ms']:>7.2f} "
            f"{r['caller_cpu_ms']:>14.3f} {r['callee_cpu_ms']:>14.3f}"
        )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
