"""The GPU JPEG decoders side by side, with CUDA spinning or sleeping in its waits.

    python bench/gpu_jpeg_decoders.py --repository models --batches 8 32 \
        --layouts 1x1 1x4 16x1 16x4

Runs what an inference replica with `decode: gpu` does to a request of JPEGs (the load
generator's built-in photos, seven sizes): the batched GPU decode, then the resize + crop
(serve_app/gpu_decode.py GpuJpegDecoder.crops), with each decoder:

- torchvision: nvJPEG's hybrid decoder through torchvision, Huffman decoding on the calling
  CPU thread, one call at a time per process (what raystream ships);
- nvimgcodec: nvImageCodec (nvidia-nvimgcodec-cu13, carried as .gpu/nvimgcodec.tar.xz by
  bench/make_nvimgcodec_bundle.sh), the GPU's hardware JPEG decoders first, then nvJPEG's
  CUDA decoder; a decoder per thread. Tried 2026-12-01 and not shipped (docs/benchmarks.md).

and each CUDA wait mode, `--waits`:

- spin: CUDA's default, which spins a core in every wait when a process has fewer contexts
  than the machine has cores (raystream's own waits sleep: engines/cuda_graphs.wait_asleep);
- block: every wait in the process sleeps (cuda_graphs.sleep_in_every_gpu_wait, the
  torch-CUDA engine's `blocking_sync` option), the ones inside nvJPEG included.

It prints how far each decoder's crops are from the CPU path's (PIL), then for each batch
size and layout PxT (P processes, like P replicas on one GPU, with T threads each, like a
replica's decode threads, running back to back) the images/s, the CPU time per image (user +
system time of the P processes over the images they decoded), and both as ratios against
torchvision with spinning waits in the same run.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import threading
from pathlib import Path

import numpy as np
from gpu_pipeline import run_for  # bench/, on the path as this script's folder

DECODERS = ("torchvision", "nvimgcodec")
WAITS = ("spin", "block")


class _NvImageCodec:
    """nvImageCodec as GpuJpegDecoder's batch decode: hardware decoder first, one decoder
    per thread (each with one CPU thread of its own: nvImageCodec's default is one per core
    in every decoder); like torchvision, a JPEG it cannot decode fails the call."""

    def __init__(self) -> None:
        import torch
        from nvidia import nvimgcodec

        self._codec, self._torch, self._threads = nvimgcodec, torch, threading.local()
        kinds = (nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.GPU_ONLY)
        self._backends = [nvimgcodec.Backend(kind) for kind in kinds]
        self._params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False,
            color_spec=nvimgcodec.ColorSpec.SRGB,
            sample_format=nvimgcodec.SampleFormat.P_RGB,  # planar: (3, H, W)
        )

    def __call__(self, jpegs: list[bytes]):
        if not hasattr(self._threads, "decoder"):
            self._threads.decoder = self._codec.Decoder(
                device_id=0, max_num_cpu_threads=1, backends=self._backends
            )
        stream = self._torch.cuda.current_stream().cuda_stream
        streams = [self._codec.CodeStream(jpeg) for jpeg in jpegs]
        images = self._threads.decoder.decode(streams, params=self._params, cuda_stream=stream)
        if any(image is None for image in images):
            raise RuntimeError("nvImageCodec could not decode a JPEG")
        return [self._torch.from_dlpack(image) for image in images]


def _decoder(kind: str, repository: Path, model: str):
    from engines.repository import resolve
    from serve_app.gpu_decode import GpuJpegDecoder
    from serve_app.preprocessing import DecodeLimits

    spec = resolve(repository, model).spec.preprocess
    batch_decode = _NvImageCodec() if kind == "nvimgcodec" else None
    return GpuJpegDecoder(spec, DecodeLimits(), decode_batch=batch_decode), spec


def _jpegs(batch: int) -> list[bytes]:
    from clients.loadgen import builtin_photos

    photos = builtin_photos()
    return [photos[i % len(photos)] for i in range(batch)]


def _distance_to_cpu(kind: str, repository: Path, model: str) -> float:
    """Mean |GPU crop - PIL crop| in grey levels over the built-in photos."""
    from serve_app.preprocessing import decode

    decoder, spec = _decoder(kind, repository, model)
    jpegs = _jpegs(7)
    crops = decoder.crops(jpegs).pixels.cpu().numpy().astype(np.int16)
    distances = [np.abs(c - decode(j, spec)).mean() for c, j in zip(crops, jpegs, strict=True)]
    return float(np.mean(distances))


def _worker(args, waits, runs, index, barrier, results) -> None:
    if waits == "block":
        import torch

        from engines.cuda_graphs import sleep_in_every_gpu_wait

        sleep_in_every_gpu_wait(torch.device("cuda", 0))
    decoders = {kind: _decoder(kind, args.repository, args.model)[0] for kind in args.decoders}
    for decoder in decoders.values():  # warm: CUDA context, nvJPEG handles, kernels
        for batch in args.batches:
            decoder.crops(_jpegs(batch))
    for kind, batch, layout in runs:
        processes, threads = map(int, layout.split("x"))
        jpegs = _jpegs(batch)
        barrier.wait()
        before = os.times()
        decode = functools.partial(decoders[kind].crops, jpegs)
        done = run_for(decode, batch, threads, args.seconds) if index < processes else 0
        after = os.times()
        cpu = (after.user - before.user) + (after.system - before.system)
        results.put((done, cpu if done else 0.0))
        barrier.wait()


def _measure(args, waits: str, runs: list) -> dict:
    """Each run's (images/s, CPU us per image), in worker processes with `waits`."""
    most = max(int(layout.split("x")[0]) for layout in args.layouts)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(most + 1), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(args, waits, runs, i, barrier, results))
        for i in range(most)
    ]
    for worker in workers:
        worker.start()
    measured = {}
    for run in runs:
        barrier.wait()
        barrier.wait()
        parts = [results.get() for _ in range(most)]
        images = sum(done for done, _ in parts)
        cpu_s = sum(cpu for _, cpu in parts)
        measured[run] = (images / args.seconds, 1e6 * cpu_s / max(images, 1))
    for worker in workers:
        worker.join()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--decoders", nargs="+", default=list(DECODERS), choices=DECODERS)
    parser.add_argument("--waits", nargs="+", default=list(WAITS), choices=WAITS)
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x4", "16x1", "16x4"])
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()

    print("mean |crop - PIL crop| over the 7 built-in photos, grey levels:")
    for kind in args.decoders:
        print(f"  {kind:<12} {_distance_to_cpu(kind, args.repository, args.model):5.2f}")

    runs = [(k, b, lay) for b in args.batches for lay in args.layouts for k in args.decoders]
    measured = {
        (waits, *run): result
        for waits in args.waits
        for run, result in _measure(args, waits, runs).items()
    }
    print(f"\n{args.seconds:.0f} s per row; ratios against torchvision, spin, in the same run")
    print("batch  layout  decoder      waits    img/s   CPU us/img   img/s ratio  CPU ratio")
    for batch in args.batches:
        for layout in args.layouts:
            base = measured.get(("spin", "torchvision", batch, layout))
            for waits in args.waits:
                for kind in args.decoders:
                    rate, cpu = measured[waits, kind, batch, layout]
                    ratios = f"{rate / base[0]:11.2f}  {cpu / base[1]:9.2f}" if base else ""
                    print(
                        f"{batch:5d}  {layout:>6}  {kind:<12} {waits:<6} {rate:7,.0f}  "
                        f"{cpu:11.1f}  {ratios}"
                    )


if __name__ == "__main__":
    main()
