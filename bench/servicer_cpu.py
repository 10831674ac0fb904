"""Where raystream's own per-request CPU goes, in one process, with no gRPC and no Ray:
the direct topology's servicer (`ClassifierService._respond`) on the `identity` 8x8 model and
the echo engine, fed ready-made `pixels` requests of 8 images, `--concurrency` at a time.

Rows, each in microseconds of process CPU (all threads) per request:
  respond              the whole servicer: checks, pipeline, response, metrics
  respond, no pipeline the same with the pipeline answering a stored result
  pipeline             batching, engine, postprocess (LocalPipeline.classify_preprocessed)
  batch + engine       the batcher and the engine call alone (Inference._infer)
  ... engine inline    the same with the engine called on the event loop instead of in the
                       engine thread: the difference is the thread hop's cost (the server
                       always uses the thread; the echo engine is the only one that could
                       run inline, so this row measures the hop, not a mode)
  stream               one bidi stream through the servicer's `Classify` (stream runner
                       included), `--concurrency` requests in flight, no gRPC
  lean stream          the same stream through bench/serving_overhead.py's LeanBatching, the
                       least a Python server that batches this way does: what raystream's
                       per-request work costs beyond batching is the difference

    python bench/servicer_cpu.py --requests 32000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import Executor, Future
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_overhead import LeanBatching, direct_service, identity_repository, tiny_png

from clients.loadgen import model_input
from raystream.v1 import classifier_pb2 as pb
from serve_app.classifier import ClassifierService
from serve_app.messages import Preprocessed


class InlineExecutor(Executor):
    """Runs each job at once on the caller's thread (the thread hop's cost, by difference)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


async def cpu_per_request(job, requests: int, concurrency: int) -> float:
    async def worker() -> None:
        for _ in range(requests // concurrency):
            await job()

    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - start) / requests * 1e6


class _Context:
    """The little of grpc.aio.ServicerContext a stream without a deadline uses."""

    def time_remaining(self) -> None:
        return None


async def stream_cpu_per_request(
    servicer, request: pb.ClassifyRequest, requests: int, concurrency: int
) -> float:
    """Process CPU per request of one bidi stream through `servicer.Classify`, keeping
    `concurrency` requests in flight (closed loop, as the load generator's streams); each
    request a copy of `request` with an id of its own, made before the clock starts."""
    stream = []
    for i in range(requests):
        stream.append(pb.ClassifyRequest())
        stream[-1].CopyFrom(request)
        stream[-1].request_id = str(i)
    sent = answered = 0
    slot = asyncio.Event()

    async def send():
        nonlocal sent
        for item in stream:
            while sent - answered >= concurrency:
                slot.clear()
                await slot.wait()
            sent += 1
            yield item

    start = time.process_time()
    async for _ in servicer.Classify(send(), _Context()):
        answered += 1
        slot.set()
    return (time.process_time() - start) / requests * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repository", type=Path, default=Path("models"))
    args = parser.parse_args()
    identity = identity_repository(args.repository)
    service = await direct_service(identity, "identity", log_sample_rate=0.0)
    pipeline = service._pipeline
    inference = pipeline._inference
    pixels = np.repeat(model_input(identity, "identity", (tiny_png(),)), 8, axis=0)
    request = pb.ClassifyRequest(request_id="r", top_k=1)
    request.pixels.shape.extend(pixels.shape)
    request.pixels.data = pixels.tobytes()

    def pre() -> Preprocessed:
        return Preprocessed(len(pixels), pixels, tuple(range(len(pixels))), ())

    stored = await pipeline.classify_preprocessed(pre(), 1)

    class StoredAnswer:
        async def classify_preprocessed(self, pre, top_k, scores=False):
            return stored

    without_pipeline = ClassifierService(service._config, service.model, StoredAnswer())
    lean = LeanBatching(identity, "identity")
    engine_thread = inference._executor
    rows = {
        "respond": lambda: service._respond(request, "bench"),
        "respond, no pipeline": lambda: without_pipeline._respond(request, "bench"),
        "pipeline": lambda: pipeline.classify_preprocessed(pre(), 1),
        "batch + engine": lambda: inference._infer(pre()),
    }
    print(f"requests of {len(pixels)} images, {args.concurrency} at a time; us CPU per request")
    for round_ in range(args.rounds):
        results = {}
        for name, job in rows.items():
            results[name] = await cpu_per_request(job, args.requests, args.concurrency)
        inference._executor = InlineExecutor()
        results["... engine inline"] = await cpu_per_request(
            rows["batch + engine"], args.requests, args.concurrency
        )
        inference._executor = engine_thread
        results["stream"] = await stream_cpu_per_request(
            service, request, args.requests, args.concurrency
        )
        results["lean stream"] = await stream_cpu_per_request(
            lean, request, args.requests, args.concurrency
        )
        print(f"round {round_}: " + "  ".join(f"{k} {v:6.1f}" for k, v in results.items()))


if __name__ == "__main__":
    asyncio.run(main())
