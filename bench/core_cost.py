"""raystream's own CPU per request, without gRPC or Ray: the v1 adapter's `Classify`, the
serving core and the stages of topology direct, in one process, fed by in-memory streams of
serialized requests (what gRPC hands the adapter) on the `echo` engine. What the served
ratio against a plain grpc.aio server (bench/scenarios/overhead.yaml) cannot say: how much
of a request's cost is raystream's code, and where it goes (`--profile`: cProfile, which
slows Python code more than C, so compare its shares, not its times).

    python bench/core_cost.py [--requests 20000] [--images 8] [--profile 30]

The default requests are those of the overhead scenario's `raystream` load (8 client tensors
of 8x8 `pixels`, 4 streams of 16 in flight) on an 8x8 model with the default model's labels
and embedding width (`identity`, from models/: python -m clients.cli export). Prints the
requests/s and the CPU per request of the whole process, every thread.

Its process allocates unlike a replica: each call's arrays of a few hundred KB are mapped
and page-faulted in afresh far more often here (glibc's thresholds set to keep them on the
heap cut its CPU by a quarter, and a served replica's by about 1%). Check a gain it shows
in a served run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import _identity_repository  # noqa: E402

from raystream.v1 import classifier_pb2 as pb  # noqa: E402
from serve_app import v1  # noqa: E402
from serve_app.config import STAGES, AppConfig  # noqa: E402
from serve_app.core.serving import ServingCore  # noqa: E402
from serve_app.pipeline.topology import StageGroup  # noqa: E402
from serve_app.protocol.streams import StreamRunner  # noqa: E402

# The Ingress user_config of deploy/serve_config.direct.yaml
DIRECT_BATCHING = {"max_batch_size": 32, "batch_wait_timeout_s": 0.0}


class _Context:
    """The part of grpc.aio's ServicerContext that Classify reads: no deadline."""

    def time_remaining(self) -> None:
        return None


def _requests(images: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(256):
        request = pb.ClassifyRequest(request_id=f"r{i}")
        request.pixels.shape.extend([images, 3, size, size])
        request.pixels.data = rng.random((images, 3, size, size), np.float32).tobytes()
        out.append(request.SerializeToString())
    return out


async def _stream(
    service: v1.ClassifierService, raws: list[bytes], count: int, images: int
) -> None:
    async def messages():
        for i in range(count):
            yield raws[i % len(raws)]
            if i % 16 == 0:
                await asyncio.sleep(0)  # as a client's messages arrive: not all at once

    answered = 0
    async for payload in service.Classify(messages(), _Context()):
        if not answered:  # the first answer read whole; the others counted (the client's cost)
            response = pb.ClassifyResponse.FromString(payload)
            if response.HasField("error") or len(response.results) != images:
                raise RuntimeError(f"request {response.request_id} failed: {response.error}")
        answered += 1
    if answered != count:
        raise RuntimeError(f"{count} requests sent, {answered} answered")


async def measure(args: argparse.Namespace, repository: Path) -> None:
    config = AppConfig(
        model_repository=repository,
        model="identity",
        engine={"kind": "echo", "batch_capacity": 64},
        limits={"max_images_per_request": 256, "max_in_flight_per_stream": args.in_flight},
        topology="direct",
        log_sample_rate=0.0,
    )
    group = await StageGroup.create(config, STAGES)
    group.reconfigure(DIRECT_BATCHING)
    core = ServingCore(config, group.info(), group.run)
    service = v1.ClassifierService(core, StreamRunner(args.in_flight))
    raws = _requests(args.images, 8)
    per_stream = args.requests // args.streams

    def streams(count: int):
        return asyncio.gather(
            *(_stream(service, raws, count, args.images) for _ in range(args.streams))
        )

    await streams(500)  # warm up
    profile = cProfile.Profile() if args.profile else None
    cpu, start = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    await streams(per_stream)
    if profile is not None:
        profile.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - start
    requests = per_stream * args.streams
    print(
        f"{requests} requests of {args.images} images, {args.streams} streams x "
        f"{args.in_flight} in flight: {requests / wall:.0f} requests/s, "
        f"{cpu / requests * 1e6:.1f} us of CPU a request"
    )
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    group.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--images", type=int, default=8, help="client tensors a request")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=16, help="requests a stream")
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--model", default="efficientnet-lite0", help="labels, embedding")
    parser.add_argument("--profile", type=int, default=0, help="cProfile's top N functions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        repository = _identity_repository(args.models, args.model, Path(root))
        asyncio.run(measure(args, repository))


if __name__ == "__main__":
    main()
