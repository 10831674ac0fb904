"""What a stage call to a replica on the caller's node costs over TCP (the node's address)
against the replica's Unix socket (serve_app/transport/unix_sockets.py): a StagePort in a
process of its own, a PortCalls caller here sending batches of `--crops` uint8 224x224 crops
one call at a time, rounds of each transport in turn. For each: per-call latency (p50, p90)
and the CPU of both processes per call (from /proc). No Ray: the transport alone.

    python bench/stage_link_local.py [--calls 300] [--rounds 3] [--crops 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve_app.core.messages import Batch, Job
from serve_app.models.registry import MemoryStore, ModelRegistry
from serve_app.transport.stage_port import PortCalls, StagePort

TOKEN = "bench"


async def _answer(batch: Batch) -> list[str]:
    return [job.id for job in batch.jobs]  # small, as Inference's top-k rows are


def _serve(addresses) -> None:
    async def main() -> None:
        port = StagePort(_answer, TOKEN, "Inference")
        address = await port.start("127.0.0.1")
        addresses.put((address, port.unix, os.getpid()))
        await asyncio.Event().wait()

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _round(calls: PortCalls, batch: Batch, n: int, server_pid: int) -> dict[str, float]:
    await calls.run(batch)  # the connection is made
    latencies = []
    cpu = time.process_time(), _cpu_s(server_pid)
    for _ in range(n):
        start = time.perf_counter()
        await calls.run(batch)
        latencies.append(time.perf_counter() - start)
    caller_s, callee_s = time.process_time() - cpu[0], _cpu_s(server_pid) - cpu[1]
    latencies.sort()
    return {
        "p50_ms": 1e3 * statistics.median(latencies),
        "p90_ms": 1e3 * latencies[int(0.9 * len(latencies))],
        "cpu_ms_per_call": 1e3 * (caller_s + callee_s) / n,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--crops", type=int, default=8)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    addresses = context.Queue()
    server = context.Process(target=_serve, args=(addresses,), daemon=True)
    server.start()
    address, unix, pid = addresses.get(timeout=60)
    crops = np.random.default_rng(0).integers(0, 255, (args.crops, 224, 224, 3), dtype=np.uint8)
    owners = np.array([(0, i) for i in range(args.crops)], dtype=np.int32)
    batch = Batch(jobs=(Job(id="a", images=()),), crops=crops, crop_owners=owners)
    registry = ModelRegistry(MemoryStore(), "bench")
    callers = {}
    for transport, sockets in (("tcp", {}), ("unix", {address: unix})):
        calls = PortCalls(registry, "Inference", None, TOKEN)
        calls.update({address: frozenset()}, sockets)
        calls.stop()  # no registry to follow: these addresses only
        callers[transport] = calls
    results: dict[str, list[dict[str, float]]] = {"tcp": [], "unix": []}
    for _ in range(args.rounds):
        for transport, calls in callers.items():
            results[transport].append(await _round(calls, batch, args.calls, pid))
    print(
        f"{args.crops} crops a call ({crops.nbytes / 1e6:.1f} MB), {args.calls} calls x "
        f"{args.rounds} rounds, one in flight; medians of the rounds:"
    )
    for transport, rounds in results.items():
        row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        print(f"  {transport:4}  " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    for calls in callers.values():
        await calls.close()
    server.terminate()


if __name__ == "__main__":
    asyncio.run(main())
