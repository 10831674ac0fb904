# Superseded by scenarios/overhead.yaml; kept: docs/performance.md runs it, oip_outputs imports it
"""Pure serving overhead, in one run: the same bidi load against (1) a plain grpc.aio server
implementing raystream.v1.ImageClassifier with no work at all, (2) the same plain server
decoding and cropping each image as raystream does, and (3) raystream on Ray Serve with the
`echo` engine (no model) in each topology, on the default model's 224x224 input, and (4)
raystream fused and direct with the echo engine on an `identity` model whose input is 8x8, so that
the tiny 8x8 PNGs are decoded but not resized, and (5) the plain server and raystream fused
and direct on that model sent the 8x8 model input itself (`pixels`, no decode anywhere): the
pure serving path, and (6) raystream's direct servicer on a plain grpc.aio server in this
process of its own (no Ray) on the same pixels, and (7) LeanBatching, the least a Python server
that batches this way must do, alone and in a Serve replica as topology direct runs: how close
any Python design on Ray Serve can come to the plain server. Every server answers one label
per image (top_k 1). Prints images/s and the ratios to (1) and (2); the `pixels` rows also
against the plain server on pixels.

Every server runs in a process of its own (the plain ones and the Ray-free servicer in a
child process, raystream in its replicas), and every load comes from one more process
without Ray, the same for all rows: the load generator shares no process, and no GIL, with
any server or with a Ray driver.

    python bench/serving_overhead.py --streams 4 --in-flight 4 --batch-size 8 --duration 15

With --max-batch-size N, raystream direct (its user_config, on Ray Serve and without Ray) and
LeanBatching form engine batches of up to N images instead of their default 32 (the echo
engine takes up to 64): each batch costs an engine-thread hop, so larger batches spread it
over more requests. The fused rows keep the default.

With --same-thread, Serve runs every replica's code on the replica's event loop thread
(RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0) instead of a separate one. Topology direct does
so anyway (serve_app/app.py DIRECT_REPLICA_ENV); RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1
in this script's environment puts it back on a separate thread.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import multiprocessing
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.loadgen import Workload, model_input, run_load
from engines.images import decode
from engines.repository import PreprocessSpec
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

SPEC = PreprocessSpec()


class PlainEcho(pb_grpc.ImageClassifierServicer):
    """The floor: the same protocol, one fixed label per image, no Ray. With `decode`, each
    image is first decoded and cropped as raystream does (2 threads), so the difference to
    raystream is Ray's share alone."""

    def __init__(self, decode: bool) -> None:
        self._pool = ThreadPoolExecutor(2) if decode else None

    async def _answer(self, request: pb.ClassifyRequest) -> pb.ClassifyResponse:
        if self._pool is not None:
            loop = asyncio.get_running_loop()
            await asyncio.gather(
                *(loop.run_in_executor(self._pool, decode, image, SPEC) for image in request.images)
            )
        response = pb.ClassifyResponse(request_id=request.request_id)
        count = len(request.images) or (request.pixels.shape[0] if request.pixels.shape else 0)
        for _ in range(count):
            response.results.add().labels.add(class_id=0, name="tench", score=1.0)
        return response

    async def Classify(self, request_iterator, context):
        async for request in request_iterator:
            yield await self._answer(request)

    async def ClassifyOnce(self, request, context):
        return await self._answer(request)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="echo")


class LeanBatching(pb_grpc.ImageClassifierServicer):
    """The floor of a Python server that batches as raystream does, on `pixels` only: each
    request's float32 rows join one queue; one worker takes up to `max_batch_size` images at
    a time, runs the echo engine in an engine thread (one hop per batch) and answers every
    request of the batch from one top-1 pass over its logits. No checks beyond the tensor's
    shape, no deadlines, limits, metrics or logs, no failure isolation: what raystream's
    direct servicer does beyond batching, it does not do."""

    def __init__(self, repository: Path, model: str, max_batch_size: int = 32) -> None:
        from engines.echo import EchoEngine
        from engines.repository import resolve

        ref = resolve(repository, model)
        self._engine, self._names = EchoEngine(ref), ref.spec.labels
        self._max = max_batch_size
        self._pending: collections.deque = collections.deque()
        self._arrived = asyncio.Event()
        self._thread = ThreadPoolExecutor(1)
        self._worker: asyncio.Task | None = None

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while self._pending:
                batch, images = [], 0
                while self._pending and (
                    not batch or images + len(self._pending[0][1]) <= self._max
                ):
                    batch.append(self._pending.popleft())
                    images += len(batch[-1][1])
                pixels = np.concatenate([rows for _, rows, _ in batch])
                logits = await loop.run_in_executor(self._thread, self._engine.infer, pixels)
                ids = logits.argmax(axis=1)
                shifted = logits - logits[np.arange(len(logits)), ids][:, None]
                scores = (1.0 / np.exp(shifted).sum(axis=1)).tolist()
                ids, row = ids.tolist(), 0
                for request_id, rows, answers in batch:
                    response = pb.ClassifyResponse(request_id=request_id)
                    for i in range(row, row + len(rows)):
                        response.results.add().labels.add(
                            class_id=ids[i], name=self._names[ids[i]], score=scores[i]
                        )
                    row += len(rows)
                    answers.put_nowait(response)

    async def Classify(self, request_iterator, context):
        if self._worker is None:
            self._worker = asyncio.create_task(self._work())
        answers: asyncio.Queue = asyncio.Queue()
        unanswered, reading = 0, True

        async def read() -> None:
            nonlocal unanswered, reading
            async for request in request_iterator:
                shape = tuple(request.pixels.shape)
                rows = np.frombuffer(request.pixels.data, "<f4").reshape(shape)
                unanswered += 1
                self._pending.append((request.request_id, rows, answers))
                self._arrived.set()
            reading = False
            answers.put_nowait(None)

        reader = asyncio.create_task(read())
        while reading or unanswered:
            response = await answers.get()
            if response is not None:
                unanswered -= 1
                yield response
        await reader

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="lean")


def tiny_png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def load_rate(address: str, workload: Workload) -> dict:
    """`workload` against `address` from a fresh process (no Ray, no server in it)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_load, address, workload).result()


def _run_load(address: str, workload: Workload) -> dict:
    return vars(asyncio.run(run_load(address, workload)))


def child_server_rate(workload: Workload, servicer: str, *args: object) -> dict:
    """Serve `servicer` ("plain" or "direct") in a child process; load it from another."""
    context = multiprocessing.get_context("spawn")
    ports = context.SimpleQueue()
    child = context.Process(target=_serve_forever, args=(ports, servicer, *args), daemon=True)
    child.start()
    try:
        return load_rate(f"127.0.0.1:{ports.get()}", workload)
    finally:
        child.terminate()
        child.join()


def _serve_forever(ports, servicer: str, *args: object) -> None:
    async def serve() -> None:
        server = grpc.aio.server()
        if servicer == "plain":
            service = PlainEcho(*args)
        elif servicer == "lean":
            service = LeanBatching(*args)
        else:
            repository, model, max_batch_size = args
            service = await direct_service(repository, model)
            if max_batch_size:
                service._pipeline._inference.reconfigure({"max_batch_size": max_batch_size})
        pb_grpc.add_ImageClassifierServicer_to_server(service, server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def direct_service(repository: Path, model: str, **extra: object):
    """raystream's servicer and pipeline as topology direct builds them (Ingress.__init__),
    with the echo engine, in this process and without Ray."""
    from serve_app.classifier import ClassifierService
    from serve_app.config import AppConfig
    from serve_app.inference import Inference
    from serve_app.pipeline import LocalPipeline

    args = {"model_repository": str(repository), "model": model, "engine": {"kind": "echo"}}
    args |= extra
    inference = await Inference.func_or_class.in_process(args)
    config = AppConfig.model_validate(args)
    return ClassifierService(config, inference.info(), LocalPipeline(config, inference))


def identity_repository(source: Path, model: str = "efficientnet-lite0") -> Path:
    """A repository holding `identity`: the source model's labels, an 8x8 input, no weights
    (only the echo engine can serve it)."""
    from engines.repository import resolve

    spec = resolve(source, model).spec
    tiny = replace(spec.preprocess, input_size=8, resize_size=8)
    identity = replace(spec, name="identity", version="1", preprocess=tiny)
    root = Path(tempfile.mkdtemp(prefix="identity-"))
    (root / "identity" / "1").mkdir(parents=True)
    (root / "identity" / "1" / "model.json").write_text(identity.to_json())
    return root


def raystream_rate(
    workload: Workload,
    topology: str,
    repository: Path,
    model: str = "efficientnet-lite0",
    max_batch_size: int | None = None,
) -> dict:
    from ray import serve

    from serve_app.app import build_app

    app = build_app(
        {
            "model_repository": str(repository),
            "model": model,
            "port": 0,
            "topology": topology,
            "engine": {"kind": "echo"},
        }
    )
    handle = serve.run(app, name="raystream", route_prefix=None)
    port = handle.port.remote().result()
    if max_batch_size and topology == "direct":  # the one replica's user_config hook
        handle.reconfigure.remote({"max_batch_size": max_batch_size}).result()
    try:
        return load_rate(f"127.0.0.1:{port}", workload)
    finally:
        serve.delete("raystream")


def lean_in_replica_rate(
    workload: Workload, repository: Path, model: str, max_batch_size: int = 32
) -> dict:
    """LeanBatching's grpc.aio server in a Serve replica, on the replica's own event loop
    (as topology direct runs: serve_app/app.py DIRECT_REPLICA_ENV)."""
    from ray import serve

    from serve_app.app import DIRECT_REPLICA_ENV

    # The replica unpickles LeanBatching by reference to this module: bench/ on its path.
    env = {**DIRECT_REPLICA_ENV, "PYTHONPATH": str(Path(__file__).resolve().parent)}

    @serve.deployment(ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": env}})
    class LeanReplica:
        async def __init__(self) -> None:
            self._server = grpc.aio.server()
            service = LeanBatching(repository, model, max_batch_size)
            pb_grpc.add_ImageClassifierServicer_to_server(service, self._server)
            self._port = self._server.add_insecure_port("127.0.0.1:0")
            await self._server.start()

        def port(self) -> int:
            return self._port

    handle = serve.run(LeanReplica.bind(), name="lean", route_prefix=None)
    try:
        return load_rate(f"127.0.0.1:{handle.port.remote().result()}", workload)
    finally:
        serve.delete("lean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--same-thread", action="store_true", help="see the module docstring")
    parser.add_argument("--max-batch-size", type=int, help="see the module docstring")
    args = parser.parse_args()
    workload = Workload(
        images=(tiny_png(),),
        batch_size=args.batch_size,
        streams=args.streams,
        in_flight=args.in_flight,
        duration_s=args.duration,
        top_k=1,
    )
    import ray
    from ray import serve

    results = {
        "plain grpc.aio": child_server_rate(workload, "plain", False),
        "plain grpc.aio + same decode": child_server_rate(workload, "plain", True),
    }
    identity = identity_repository(args.repository)
    on_pixels = replace(workload, pixels=model_input(identity, "identity", workload.images))
    results["plain grpc.aio, pixels"] = child_server_rate(on_pixels, "plain", False)
    # raystream's direct servicer and pipeline without Ray: between this and the plain
    # server lies raystream's per-request code; between this and `direct` on Ray Serve,
    # the replica's process and Ray's.
    batch = args.max_batch_size
    results["direct servicer, no Ray, pixels"] = child_server_rate(
        on_pixels, "direct", identity, "identity", batch
    )
    # The floor of any Python server that batches the same way (LeanBatching): between it
    # and the plain server lies batching in Python; between it and the row above, raystream's
    # checks, deadlines, failure isolation, metrics and logs.
    results["lean batching server, no Ray, pixels"] = child_server_rate(
        on_pixels, "lean", identity, "identity", batch or 32
    )
    env = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"} if args.same_thread else {}
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    serve.start(proxy_location="Disabled")
    for topology in ("fused", "chained", "direct"):
        results[f"raystream {topology}, echo engine"] = raystream_rate(
            workload, topology, args.repository
        )
    for topology in ("fused", "direct"):
        results[f"raystream {topology}, identity 8x8"] = raystream_rate(
            workload, topology, identity, model="identity"
        )
    for topology in ("fused", "direct"):
        results[f"raystream {topology}, identity, pixels"] = raystream_rate(
            on_pixels, topology, identity, "identity", batch
        )
    results["lean batching server in a Serve replica, pixels"] = lean_in_replica_rate(
        on_pixels, identity, "identity", batch or 32
    )
    serve.shutdown()
    ray.shutdown()
    base = results["plain grpc.aio"]["images_per_s"]
    same_work = results["plain grpc.aio + same decode"]["images_per_s"]
    base_pixels = results["plain grpc.aio, pixels"]["images_per_s"]
    print(
        f"{args.streams} streams x {args.in_flight} in flight, {args.batch_size} images "
        f"(8x8 PNG) per request, {args.duration:.0f} s each, engine batches of up to "
        f"{batch or 32} images (direct and lean)"
    )
    for name, r in results.items():
        print(
            f"{name:<34} {r['images_per_s']:9.1f} img/s  {r['requests_per_s']:8.1f} req/s  "
            f"p50 {r['latency_ms']['p50']:7.2f} ms  ratio {r['images_per_s'] / base:5.2f}  "
            f"vs same work {r['images_per_s'] / same_work:5.2f}"
            + (
                f"  vs plain on pixels {r['images_per_s'] / base_pixels:5.2f}"
                if "pixels" in name
                else ""
            )
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
