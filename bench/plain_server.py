"""The floor for raystream's serving path: a plain grpc.aio server in one process that
implements raystream.v1.ImageClassifier with canned answers (top_k fixed labels per image,
no model, no Ray). bench/run.py starts it for a `plain_server` load and measures it with the
same load generator and the same CPU accounting as raystream, so one run gives raystream's
img/s and CPU per image against it.

    python bench/plain_server.py --port 9250 [--decode-threads 2] [--hash-images]

With --hash-images it also hashes every image with BLAKE3, as raystream's result cache keys
them: the work that a cache hit cannot skip. With --decode-threads N it also decodes and
crops every image as raystream does (engines.images.decode, N threads; the default model's
resize to 256 and crop to 224, or with --decode-size S a resize to S and no crop): the same
work without Ray or batching.
Prints `plain server ready on HOST:PORT` once it listens; SIGINT or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import grpc

ROOT = Path(__file__).resolve().parents[1]
try:
    from raystream.v1 import classifier_pb2 as pb
    from raystream.v1 import classifier_pb2_grpc as pb_grpc
except ImportError:
    sys.path.insert(0, str(ROOT / "protos"))
    from raystream.v1 import classifier_pb2 as pb
    from raystream.v1 import classifier_pb2_grpc as pb_grpc

LABELS = ("tench", "goldfish", "great white shark", "tiger shark", "hammerhead")


class PlainClassifier(pb_grpc.ImageClassifierServicer):
    def __init__(self, decode_threads: int, decode_size: int = 0, hash_images: bool = False):
        self._pool = None
        self._hash = hash_images
        if decode_threads:
            sys.path.insert(0, str(ROOT))
            from engines.images import decode
            from engines.repository import PreprocessSpec

            size = {"input_size": decode_size, "resize_size": decode_size} if decode_size else {}
            self._decode, self._spec = decode, PreprocessSpec(**size)
            self._pool = ThreadPoolExecutor(decode_threads)

    async def _answer(self, request: pb.ClassifyRequest) -> pb.ClassifyResponse:
        if self._hash:
            for image in request.images:
                blake3.blake3(image).digest(16)
        if self._pool is not None:
            loop = asyncio.get_running_loop()
            await asyncio.gather(
                *(
                    loop.run_in_executor(self._pool, self._decode, image, self._spec)
                    for image in request.images
                )
            )
        response = pb.ClassifyResponse(request_id=request.request_id)
        k = min(request.top_k or 5, len(LABELS))
        rows = request.pixels.shape[0] if request.HasField("pixels") else len(request.images)
        for _ in range(rows):
            result = response.results.add()
            for i in range(k):
                result.labels.add(class_id=i, name=LABELS[i], score=0.2)
        return response

    async def Classify(self, request_iterator, context):
        # Requests of a stream run concurrently and are answered in completion order, as
        # raystream answers them.
        answers: asyncio.Queue = asyncio.Queue()
        pending, tasks = 0, set()

        async def one(request):
            answers.put_nowait(await self._answer(request))

        async def read():
            nonlocal pending
            async for request in request_iterator:
                pending += 1
                task = asyncio.ensure_future(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        reading = True
        while reading or pending:
            answer = await answers.get()
            if answer is None:
                reading = False
            else:
                pending -= 1
                yield answer
        await reader

    async def ClassifyOnce(self, request, context):
        return await self._answer(request)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="plain", version="1", engine="none")


async def serve(host: str, port: int, decode_threads: int, decode_size: int, hash_images: bool):
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20)])
    servicer = PlainClassifier(decode_threads, decode_size, hash_images)
    pb_grpc.add_ImageClassifierServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"plain server ready on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--decode-threads", type=int, default=0)
    parser.add_argument("--decode-size", type=int, default=0)
    parser.add_argument("--hash-images", action="store_true")
    args = parser.parse_args()
    asyncio.run(
        serve(args.host, args.port, args.decode_threads, args.decode_size, args.hash_images)
    )


if __name__ == "__main__":
    main()
