"""The GPU decode path's CPU when several processes decode at once on one GPU, as the
Inference replicas do: 1, 12, then 4 processes each run GpuJpegDecoder.crops_many (an
Inference replica's decode thread: batched nvJPEG, resize, crop) on calls of 64 of
bench/load.py's photos (`--batch`) for 6 s, all together; prints img/s and CPU ms an image
over all of them, split into user and kernel time, with a call's mean wall time and the
context switches a call makes (a thread that sleeps while the GPU works switches; one
that spins does not), and appends it to $OUT/procs.txt. `--decode-only`: the batched
decode call alone, without the resize and crop. `--decoder nvimgcodec`: nvImageCodec's
batched decode (its hardware JPEG backend, then CUDA; in the GPU bundle for this comparison
only) instead of torchvision's.
`--profile`: py-spy's native stacks of one process of each count over its window, summed per
function into $OUT/decode-native-<decoder>-<n>.txt (where its CPU goes: nvJPEG, CUDA, the rest).
`--spin`: leave CUDA's waits as they are (without it every wait sleeps). Under CUDA MPS, as
the GPU configs run:

    bash bench/gpu_mps.sh python3 bench/decode_procs.py       (after: source bench/gpu_env.sh)
    bash bench/gpu_mps.sh python3 bench/decode_procs.py --processes 12 --decode-only --batch 8
    bash bench/gpu_mps.sh python3 bench/decode_procs.py --decoder nvimgcodec
    bash bench/gpu_mps.sh python3 bench/decode_procs.py --processes 12 --chunk 8
    bash bench/gpu_mps.sh python3 bench/decode_procs.py --processes 12 --profile

`--chunk N`: the decoder hands nvJPEG N JPEGs a call; without it, the whole call at once,
as an Inference replica does. `--at-once K`: at most K of the processes in a call at a time
(a semaphore they share; the others wait asleep), so fewer threads poll the JPEG engines
while as many processes keep calls ready:

    bash bench/gpu_mps.sh python3 bench/decode_procs.py --processes 12 --spin --at-once 3

Latency at low load: `--gap-ms G` makes each process wait G ms after each call (12 processes
of calls of 8 with 190 ms gaps offer about 500 img/s), and the line adds each call's p50 and
p99 wall time; `--queued` sends each call through an Inference replica's own path in the
process (serve_app/stages/nvjpeg_queue.py on an asyncio loop: its batcher, its decode thread and the
hand-offs between them). Where a served request's decode takes longer than here, the
difference is the server around it:

    bash bench/gpu_mps.sh python3 bench/decode_procs.py --processes 1,12 --batch 8 --spin \
        --gap-ms 190 --queued
"""

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import profiles  # noqa: E402

SECONDS = 6.0


def nvimgcodec_decode(device: int):
    """nvImageCodec's batched decode in GpuJpegDecoder's place: RGB images as (3, H, W)
    views on the GPU, decoded on the caller's current CUDA stream, one CPU thread."""
    import torch
    from nvidia import nvimgcodec

    decoder = nvimgcodec.Decoder(
        device_id=device,
        max_num_cpu_threads=1,
        backends=[
            nvimgcodec.Backend(nvimgcodec.HW_GPU_ONLY),
            nvimgcodec.Backend(nvimgcodec.GPU_ONLY),
        ],
    )
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, sample_format=nvimgcodec.I_RGB)

    def decode_batch(jpegs: list[bytes]) -> list[torch.Tensor]:
        stream = torch.cuda.current_stream()
        streams = [nvimgcodec.CodeStream(jpeg) for jpeg in jpegs]
        images = decoder.decode(streams, params=params, cuda_stream=stream.cuda_stream)
        return [torch.as_tensor(image, device=stream.device).permute(2, 0, 1) for image in images]

    return decode_batch


def worker(args, start_at, queue, at_once):
    import load
    import torch

    from engines.cuda_graphs import sleep_in_every_gpu_wait, wait_asleep
    from engines.gpu_decode import GpuJpegDecoder
    from engines.images import DecodeLimits
    from engines.repository import PreprocessSpec

    if not args.spin:
        sleep_in_every_gpu_wait(torch.device("cuda:0"))
    photos = load.builtin_photos()
    jpegs = [photos[i % len(photos)] for i in range(args.batch)]
    if args.queued:
        queue.put(asyncio.run(_queued_calls(args, jpegs, start_at)))
        return
    decode_batch = nvimgcodec_decode(0) if args.decoder == "nvimgcodec" else None
    decoder = GpuJpegDecoder(
        PreprocessSpec(), DecodeLimits(), decode_batch=decode_batch, chunk=args.chunk or None
    )

    def decode_alone():  # no resize or crop: where the CPU goes, the decode or the rest
        decoder.decode_in_chunks(jpegs)
        wait_asleep(torch.cuda.current_stream())

    decode = decode_alone if args.decode_only else lambda: decoder.crops_many([jpegs])
    decode()
    gate = at_once or contextlib.nullcontext()  # at most --at-once processes in a call

    def work():
        with gate:
            decode()

    time.sleep(max(start_at - time.time(), 0))
    before, walls, end = resource.getrusage(resource.RUSAGE_SELF), [], time.time() + SECONDS
    while time.time() < end:
        began = time.perf_counter()
        work()
        walls.append(time.perf_counter() - began)
        time.sleep(args.gap_ms / 1000)
    queue.put(_usage(before, walls))


async def _queued_calls(args, jpegs, start_at):
    """The calls through an Inference replica's decode queue, on this process' event loop."""
    from engines.repository import PreprocessSpec
    from serve_app.config import AppConfig
    from serve_app.stages.nvjpeg_queue import NvjpegQueue

    decoder = NvjpegQueue(AppConfig(decode="gpu"), PreprocessSpec(), chunk=args.chunk or None)
    await decoder.warm()
    await decoder.decode(jpegs)
    await asyncio.sleep(max(start_at - time.time(), 0))
    before, walls, end = resource.getrusage(resource.RUSAGE_SELF), [], time.time() + SECONDS
    while time.time() < end:
        began = time.perf_counter()
        await decoder.decode(jpegs)
        walls.append(time.perf_counter() - began)
        await asyncio.sleep(args.gap_ms / 1000)
    usage = _usage(before, walls)
    await decoder.close()
    return usage


def _usage(before, walls: list[float]) -> tuple:
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (
        len(walls),
        after.ru_utime - before.ru_utime,
        after.ru_stime - before.ru_stime,
        after.ru_nvcsw - before.ru_nvcsw + after.ru_nivcsw - before.ru_nivcsw,
        walls,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,12,4", help="process counts, in turn")
    parser.add_argument("--decode-only", action="store_true", help="the decode alone, no crop")
    parser.add_argument("--batch", type=int, default=64, help="photos a call")
    parser.add_argument(
        "--chunk", type=int, default=0, help="JPEGs a batched nvJPEG call (0: the whole call)"
    )
    parser.add_argument("--decoder", choices=("torchvision", "nvimgcodec"), default="torchvision")
    parser.add_argument("--profile", action="store_true", help="py-spy --native of one process")
    parser.add_argument("--spin", action="store_true", help="CUDA's waits as they are")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="each process' pause a call")
    parser.add_argument("--queued", action="store_true", help="through the replica's queue")
    parser.add_argument(
        "--at-once", type=int, default=0, help="at most this many processes in a call (0: all)"
    )
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp")) / "procs.txt"
    ctx = mp.get_context("spawn")
    for n in map(int, args.processes.split(",")):
        queue = ctx.Queue()
        start_at = time.time() + 25
        at_once = ctx.BoundedSemaphore(args.at_once) if args.at_once else None
        procs = [
            ctx.Process(target=worker, args=(args, start_at, queue, at_once)) for _ in range(n)
        ]
        for p in procs:
            p.start()
        if args.profile:
            raw = out.with_name(f"decode-native-{args.decoder}-{n}.raw")
            profile = _profile(procs[0].pid, start_at, raw)
        results = [queue.get(timeout=90) for _ in procs]
        if args.profile:
            profile.wait()
            text = profiles.summary(raw, 30) if raw.exists() else "py-spy wrote nothing\n"
            raw.with_suffix(".txt").write_text(text)
        for p in procs:
            p.join()
        calls, user, system, switches = (sum(r[i] for r in results) for i in range(4))
        walls = sorted(wall for r in results for wall in r[4])
        mean_ms = statistics.fmean(walls) * 1000 if walls else 0.0
        images = calls * args.batch
        line = (
            f"{n:2} processes, {args.decoder}{', spinning' * args.spin}, calls of {args.batch}"
            f"{f' in chunks of {args.chunk}' * bool(args.chunk)}"
            f"{', decode alone' * args.decode_only}{', queued' * args.queued}"
            f"{f', at most {args.at_once} at once' * bool(args.at_once)}"
            f"{f', {args.gap_ms:g} ms gaps' * bool(args.gap_ms)}: {images / SECONDS:8.0f} img/s  "
            f"{(user + system) * 1000 / images:.3f} CPU ms/img (user {user * 1000 / images:.3f}, "
            f"kernel {system * 1000 / images:.3f}), a call's mean {mean_ms:.1f} ms, "
            f"{switches / calls:.1f} switches; a call's wall p50 "
            f"{_at(walls, 0.5):.2f} ms, p99 {_at(walls, 0.99):.2f} ms"
        )
        print(line, flush=True)
        with out.open("a") as f:
            f.write(line + "\n")


def _at(walls: list[float], quantile: float) -> float:
    """The quantile of sorted wall times, in ms."""
    return walls[min(int(quantile * len(walls)), len(walls) - 1)] * 1000 if walls else 0.0


def _profile(pid: int, start_at: float, raw: Path) -> subprocess.Popen:
    """py-spy's native stacks of `pid` over the measured window (it pauses the process for
    each sample, so that process's own figures read a little low)."""
    time.sleep(max(start_at + 0.5 - time.time(), 0))
    command = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(SECONDS) - 1)]
    command += ["--rate", str(profiles.RATE), "--format", "raw", "--native", "-o", str(raw)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
