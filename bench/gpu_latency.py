"""Open-loop latency of an inference replica's GPU work, without gRPC or Ray: where do the
milliseconds of a request go at half load?

    python bench/gpu_latency.py --processes 4 --rate 33 --batch 32 --pieces 8 32

Each of P processes hosts what a `topology: direct`, `decode: gpu` replica runs for a request:
the header checks (serve_app/stages.Preprocessor), the nvJPEG decode in pieces through the
decode batcher, the engine's dynamic batcher, the torch-CUDA engine and postprocess
(`Inference.in_process`, the replica's own code). Requests of `--batch` built-in photos
arrive as a Poisson process at `--rate` per second in each process. For each decode piece
size it prints end-to-end p50/p99 and the medians and p99s of the parts: header checks,
decode (with its wait for a decode thread), engine queue and engine batch.

`--gil-probe` first measures whether a decode call blocks the other Python threads: a
thread decodes batches back to back while the main thread asks for 0.5 ms sleeps, and the
longest late wake-ups are printed beside the same loop with no decode running.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import threading
import time
from pathlib import Path

import numpy as np


def _config(args) -> dict:
    from serve_app.config import AppConfig

    options = {"compile_min_batch": 32} if args.compile else {}
    engine = {"kind": args.engine, "precision": "fp16", "max_batch_size": 64, "options": options}
    config = AppConfig(
        model_repository=args.repository, decode="gpu", preprocess_threads=12, engine=engine
    )
    return config.model_dump(mode="json")


async def _open_loop(preprocessor, replica, jpegs, rate: float, seconds: float, seed: int):
    """Poisson arrivals for `seconds`; (total, checks, decode, queue, engine) ms per request."""
    rng = np.random.default_rng(seed)
    rows = []

    async def one() -> None:
        start = time.perf_counter()
        pre = await preprocessor.run(jpegs)
        done = await replica(pre, 1)
        total = (time.perf_counter() - start) * 1000.0
        timing = done.timing
        decode = timing.preprocess_ms - pre.timing.preprocess_ms
        rows.append((total, pre.timing.preprocess_ms, decode, timing.queue_ms, timing.inference_ms))

    tasks, start = [], time.perf_counter()
    due = start
    while True:
        due += rng.exponential(1.0 / rate)
        if due > start + seconds:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return rows


def _gil_probe(decoder, jpegs, seconds: float = 3.0) -> dict[str, float]:
    """Late wake-ups of 0.5 ms sleeps in this thread, with and without a decoding thread."""

    def lateness(until: float) -> np.ndarray:
        late = []
        while time.perf_counter() < until:
            start = time.perf_counter()
            time.sleep(0.0005)
            late.append((time.perf_counter() - start) * 1000.0 - 0.5)
        return np.array(late)

    quiet = lateness(time.perf_counter() + seconds)
    stop = time.perf_counter() + seconds
    calls = [0]

    def decode_loop() -> None:
        while time.perf_counter() < stop:
            decoder.decode_batch(jpegs)
            calls[0] += 1

    thread = threading.Thread(target=decode_loop)
    thread.start()
    busy = lateness(stop)
    thread.join()
    return {
        "quiet p99 / max ms": (np.percentile(quiet, 99), quiet.max()),
        "decoding p99 / max ms": (np.percentile(busy, 99), busy.max()),
        "decode call ms": seconds * 1000.0 / max(calls[0], 1),
    }


def _worker(args, index: int, barrier, results) -> None:
    from clients.loadgen import builtin_photos
    from engines.repository import resolve
    from serve_app import inference, stages
    from serve_app.config import AppConfig
    from serve_app.gpu_decode import GpuJpegDecoder
    from serve_app.preprocessing import DecodeLimits

    photos = builtin_photos()
    jpegs = [photos[i % len(photos)] for i in range(args.batch)]

    async def main() -> None:
        config = _config(args)
        preprocessor = stages.Preprocessor(AppConfig.model_validate(config))
        replica = await inference.Inference.func_or_class.in_process(config)
        if args.gil_probe and index == 0:
            spec = resolve(args.repository, "efficientnet-lite0").spec.preprocess
            results.put(("gil", _gil_probe(GpuJpegDecoder(spec, DecodeLimits()), jpegs)))
        for _ in range(20):  # warm: the decoder, each resize size, the batch buckets
            await replica(await preprocessor.run(jpegs), 1)
        for piece in args.pieces:
            inference.DECODE_PIECE = piece
            barrier.wait()
            rows = await _open_loop(
                preprocessor, replica, jpegs, args.rate, args.seconds, seed=index * 1000 + piece
            )
            results.put((piece, rows))

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rate", type=float, default=33.0, help="requests/s per process")
    parser.add_argument("--batch", type=int, default=32, help="images per request")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--pieces", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--engine", default="torch-cuda")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine")
    parser.add_argument("--gil-probe", action="store_true")
    parser.add_argument("--label", default="")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.processes), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(args, i, barrier, results)) for i in range(args.processes)
    ]
    for worker in workers:
        worker.start()
    expected = args.processes * len(args.pieces) + (1 if args.gil_probe else 0)
    by_piece: dict[int, list] = {}
    for _ in range(expected):
        key, value = results.get()
        if key == "gil":
            print("GIL probe (one process, before the loads):")
            for name, v in value.items():
                shown = " / ".join(f"{x:.2f}" for x in v) if isinstance(v, tuple) else f"{v:.2f}"
                print(f"  {name:<24} {shown}")
        else:
            by_piece.setdefault(key, []).extend(value)
    for worker in workers:
        worker.join()
    offered = args.processes * args.rate * args.batch
    print(
        f"{args.label} {args.processes} processes x {args.rate:g} req/s of {args.batch} JPEGs "
        f"= {offered:,.0f} img/s offered, {args.seconds:g} s; ms, p50 / p99:"
    )
    names = ("end to end", "header checks", "decode+wait", "engine queue", "engine batch")
    print(f"  {'piece':>5}  " + "  ".join(f"{n:>15}" for n in names))
    for piece, rows in by_piece.items():
        table = np.array(rows)
        cells = [
            f"{np.percentile(table[:, c], 50):6.1f} /{np.percentile(table[:, c], 99):6.1f}"
            for c in range(table.shape[1])
        ]
        print(f"  {piece:>5}  " + "  ".join(f"{c:>15}" for c in cells))


if __name__ == "__main__":
    main()
