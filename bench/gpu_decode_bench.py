"""The GPU decode path's cost on a GPU host, without a server: images/s and CPU milliseconds per
image (all threads of this process) for torchvision's batched nvJPEG decode alone, the resize
and crop alone (engines/gpu_decode.crop_batch), and both (GpuJpegDecoder.crops_many, what an
Inference replica runs), from 1 and 4 threads, on bench/load.py's photos.

    python bench/gpu_decode_bench.py [--seconds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import load  # noqa: E402

from engines.cuda_graphs import sleep_in_every_gpu_wait  # noqa: E402
from engines.gpu_decode import GpuJpegDecoder, crop_batch  # noqa: E402
from engines.images import DecodeLimits  # noqa: E402
from engines.repository import PreprocessSpec  # noqa: E402


def measure(work, images_per_call: int, threads: int, seconds: float) -> dict:
    """Calls `work()` from `threads` threads for `seconds`; img/s and CPU ms per image."""
    work()  # warm
    torch.cuda.synchronize()
    deadline = time.perf_counter() + seconds
    calls = [0] * threads

    def loop(index: int) -> None:
        while time.perf_counter() < deadline:
            work()
            calls[index] += 1
        torch.cuda.synchronize()

    cpu, wall = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(loop, range(threads)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    images = sum(calls) * images_per_call
    return {"images_per_s": images / wall, "cpu_ms_per_image": cpu * 1000 / images}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sleep_in_every_gpu_wait(torch.device("cuda:0"))  # as the Inference replicas do
    photos = load.builtin_photos()
    spec = PreprocessSpec()
    decoder = GpuJpegDecoder(spec, DecodeLimits())
    rows = []
    for batch in (8, 64):
        jpegs = [photos[i % len(photos)] for i in range(batch)]
        decoded = decoder.decode_batch(jpegs)
        cases = {
            "decode": lambda jpegs=jpegs: decoder.decode_batch(jpegs),
            "crop": lambda decoded=decoded: crop_batch(decoded, spec),
            "decode+crop": lambda jpegs=jpegs: decoder.crops_many([jpegs]),
        }
        for name, work in cases.items():
            for threads in (1, 4):
                row = {"case": name, "batch": batch, "threads": threads}
                row |= measure(work, batch, threads, args.seconds)
                rows.append(row)
                print(
                    f"{name:12} batch {batch:3} threads {threads}: "
                    f"{row['images_per_s']:9.0f} img/s {row['cpu_ms_per_image']:.3f} CPU ms/img",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
