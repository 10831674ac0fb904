"""The GPU server's per-image work without the server: how many images/s can one GPU take?

    python bench/gpu_pipeline.py --repository models --layouts 1x1 1x4 2x4 4x4

Runs what an inference replica with `decode: gpu` does to a request of `--batch` JPEGs
(the built-in photos): batched nvJPEG decode and the resize + crop, one call per distinct
image size (serve_app/gpu_decode.py), then the torch-CUDA engine on the crops where they are
(normalize, graph replay). It prints

1. each stage's time for one batch, one thread (wall clock, the GPU synchronized; medians),
   with its GPU busy time and kernel count, beside the code it replaced (marked "before":
   one resize per distinct image size, the crops copied to the host and uploaded again);
2. the GPU's busy time per image: the union of every kernel's and copy's interval in a
   torch.profiler trace of the whole pipeline (what nvidia-smi counts as busy), which bounds
   the images/s that one GPU can reach when nothing overlaps;
3. images/s for each layout PxT: P processes (like P inference replicas on one GPU) with T
   threads each running the pipeline back to back; ratios against the first layout.

Run it once plainly and once under CUDA MPS (see bench/gpu_mps.sh) to compare time-slicing
between processes with kernels from several processes sharing the GPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch


def _pipeline(repository: Path, model: str, batch: int, options: dict):
    """(run, stages): run() does one batch end to end; stages names each step's callable."""
    from clients.loadgen import builtin_photos
    from engines import create_engine
    from engines.repository import resolve
    from serve_app.gpu_decode import GpuJpegDecoder, crop_batch
    from serve_app.preprocessing import DecodeLimits

    ref = resolve(repository, model)
    spec = ref.spec.preprocess
    photos = builtin_photos()
    jpegs = [photos[i % len(photos)] for i in range(batch)]
    decoder = GpuJpegDecoder(spec, DecodeLimits())
    engine = create_engine("torch-cuda", ref, max_batch_size=batch, precision="fp16", **options)
    engine.warmup()
    mean, std = spec.mean_array, spec.std_array

    def run() -> np.ndarray:  # as an inference replica does: the crops stay on the GPU
        return engine.infer_uint8(decoder.crops(jpegs).pixels, mean, std)

    images = decoder.decode_batch(jpegs)
    crops_gpu = crop_batch(images, spec)
    crops = crops_gpu.cpu().numpy()
    stages = {
        "nvJPEG decode": lambda: decoder.decode_batch(jpegs),
        "resize + crop": lambda: crop_batch(images, spec),
        "resize + crop, per size (before)": lambda: _crop_per_size(images, spec),
        "crops to host (before)": lambda: crops_gpu.cpu(),
        "engine, crops on the GPU": lambda: engine.infer_uint8(crops_gpu, mean, std),
        "engine, crops uploaded (before)": lambda: engine.infer_uint8(crops, mean, std),
        "all of it": run,
    }
    return run, stages


def _crop_per_size(images: list[torch.Tensor], spec) -> torch.Tensor:
    """The resize + crop that serve_app/gpu_decode.py used before 2026-12-01, kept as the
    baseline: the same crops as crop_batch, but scattered into the output with a list of
    rows per distinct size (a host-to-GPU copy of the list and a stream wait each)."""
    import torch.nn.functional as F

    size = spec.input_size
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=images[0].device)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        groups.setdefault(tuple(image.shape[1:]), []).append(index)
    for (height, width), indices in groups.items():
        scale = spec.resize_size / min(width, height)
        new_h, new_w = max(size, round(height * scale)), max(size, round(width * scale))
        resized = F.interpolate(
            torch.stack([images[i] for i in indices]).float(),
            size=(new_h, new_w),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        top, left = (new_h - size) // 2, (new_w - size) // 2
        crop = resized[:, :, top : top + size, left : left + size]
        out[indices] = crop.round_().clamp_(0, 255).to(torch.uint8)
    return out.permute(0, 2, 3, 1).contiguous()


def _median_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def _busy_us_per_image(run, batch: int, repeats: int = 10) -> tuple[float, int]:
    """GPU busy time per image (union of device-side intervals) and kernels per batch."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / (repeats * batch), len(spans) // repeats


def run_for(run, batch: int, threads: int, seconds: float) -> int:
    """Images done by `threads` threads running the pipeline back to back for `seconds`."""
    stop = time.perf_counter() + seconds
    done = [0] * threads

    def loop(t: int) -> None:
        while time.perf_counter() < stop:
            run()
            done[t] += batch

    pool = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return sum(done)


def _worker(args, index, ready, go, counts) -> None:
    run, _ = _pipeline(args.repository, args.model, args.batch, args.engine_options)
    ready.wait()
    for layout in args.layouts:
        processes, threads = map(int, layout.split("x"))
        go.wait()
        done = run_for(run, args.batch, threads, args.seconds) if index < processes else 0
        counts.put(done)
        go.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x4", "2x4", "4x4"])
    parser.add_argument("--label", default="", help="a name for this run in the table")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine")
    args = parser.parse_args()
    args.engine_options = {"compile_min_batch": args.batch} if args.compile else {}

    run, stages = _pipeline(args.repository, args.model, args.batch, args.engine_options)
    print(f"one batch of {args.batch} JPEGs, one thread ({args.label}):")
    medians = {}
    for name, fn in stages.items():
        medians[name] = ms = _median_ms(fn)
        busy_us, kernels = _busy_us_per_image(fn, args.batch)
        print(
            f"  {name:<36} {ms:7.2f} ms  {1000 * ms / args.batch:7.1f} us/image  GPU busy "
            f"{busy_us:6.1f} us/image, {kernels:4d} kernels and copies"
        )
    ratio = medians["resize + crop"] / medians["resize + crop, per size (before)"]
    print(f"  resize + crop: {ratio:.2f}x the time of the per-size code, same run")
    busy_us, kernels = _busy_us_per_image(run, args.batch)
    print(
        f"  GPU busy per image {busy_us:.1f} us ({kernels} kernels and copies per batch): "
        f"at most {1e6 / busy_us:,.0f} img/s with nothing overlapping"
    )
    del run, stages
    torch.cuda.empty_cache()

    ctx = mp.get_context("spawn")
    most = max(int(layout.split("x")[0]) for layout in args.layouts)
    ready, go = ctx.Barrier(most + 1), ctx.Barrier(most + 1)
    counts = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(args, i, ready, go, counts)) for i in range(most)]
    for worker in workers:
        worker.start()
    ready.wait()
    rates = {}
    for layout in args.layouts:
        go.wait()
        total = sum(counts.get() for _ in range(most))
        go.wait()
        rates[layout] = total / args.seconds
    for worker in workers:
        worker.join()
    first = rates[args.layouts[0]]
    print(f"processes x threads, {args.seconds:.0f} s each ({args.label}):")
    for layout, rate in rates.items():
        print(f"  {layout:<6} {rate:9,.0f} img/s  {rate / first:5.2f}x {args.layouts[0]}")


if __name__ == "__main__":
    main()
