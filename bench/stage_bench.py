"""The stages' own cost, without Ray: one process runs the three stages as the replicas of a
config run them (by default `deploy/serve_config.gpu.yaml`; header reads, nvJPEG decode and
crop, the batcher and the engine, top-k, the answers' bytes), fed calls as the ingress sends
them: `jobs` requests of `images` photos each, `calls` of them in flight. It prints the
images/s and the process' CPU per image (all its threads), for comparison with the stage
replicas' CPU in a served run (bench/run.py): the difference is what the Ray calls around
the stages cost.

    python bench/stage_bench.py [--seconds 6] [--shapes 21x1x2,16x8x2,64x1x2]
    python bench/stage_bench.py --config deploy/serve_config.yaml --settle 0 --shapes 4x8x2

The model from `models/` (python -m clients.cli export); the config's decode and engine (the
GPU config on a GPU host; the CPU default decodes with PIL and runs ONNX Runtime).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from load import builtin_photos, unique_variant  # noqa: E402  (bench/load.py)

from serve_app.config import AppConfig  # noqa: E402
from serve_app.core.messages import Batch, Job  # noqa: E402
from serve_app.pipeline.topology import StageGroup  # noqa: E402


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Photos:
    """Each photo made unique (a comment segment), as the load generator sends them."""

    def __init__(self) -> None:
        self._photos = builtin_photos()
        self._next = 0

    def take(self, count: int) -> tuple[bytes, ...]:
        out = []
        for _ in range(count):
            photo = self._photos[self._next % len(self._photos)]
            out.append(b"".join(unique_variant(photo, str(self._next).encode())))
            self._next += 1
        return tuple(out)


async def measure(front: StageGroup, back: StageGroup, shape: tuple[int, int, int], seconds):
    jobs, images, calls = shape
    photos = Photos()
    done = 0
    end = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < end:
            batch = Batch(tuple(Job(id=f"r{i}", images=photos.take(images)) for i in range(jobs)))
            answers = await back.run(await front.run(batch))
            assert all(answer.code == 0 for answer in answers), answers[0].message
            done += jobs * images

    start, cpu = time.perf_counter(), cpu_s()
    await asyncio.gather(*(caller() for _ in range(calls)))
    wall, used = time.perf_counter() - start, cpu_s() - cpu
    return done / wall, 1000.0 * used / done


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/serve_config.gpu.yaml")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--settle", type=float, default=20.0, help="background captures")
    parser.add_argument(
        "--no-compile", action="store_true", help="the engine uncompiled: a quicker start"
    )
    shapes = "21x1x2,42x1x1,2x8x4,16x8x2,32x8x2"
    parser.add_argument("--shapes", default=shapes, help="jobs x images x calls in flight")
    args = parser.parse_args()
    served = yaml.safe_load((ROOT / args.config).read_text())["applications"][0]["args"]
    if args.no_compile:
        served["engine"]["options"] = {}
    config = AppConfig.model_validate(served)
    front = await StageGroup.create(config, ("preprocess", "inference"))
    back = await StageGroup.create(config, ("postprocess",))
    await asyncio.sleep(args.settle)
    rows = []
    for text in args.shapes.split(","):
        shape = tuple(int(n) for n in text.split("x"))
        await measure(front, back, shape, 1.0)  # warm this shape's buckets
        rate, cpu_ms = await measure(front, back, shape, args.seconds)
        rows.append((text, rate, cpu_ms))
        print(f"{text}: {rate:,.0f} img/s, {cpu_ms:.3f} CPU ms/img", flush=True)
    print("\nshape (jobs x images x calls)  img/s    CPU ms/img")
    for text, rate, cpu_ms in rows:
        print(f"{text:<30} {rate:>8,.0f} {cpu_ms:>8.3f}")


if __name__ == "__main__":
    asyncio.run(main())
