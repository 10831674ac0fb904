"""What an abusive client costs a running server, measured with a plain grpcio client.

    make serve &            # or any raystream server on ADDRESS, on this machine
    python bench/abuse.py [--address 127.0.0.1:9000] [--only fairness,backlog,memory]

1. fairness: a victim sends one-photo requests on its own connection, one at a time, while an
   attacker's stream sends two requests of 32 16-bit greyscale PNGs of 6324x6324 pixels
   (5 MB in all, seconds of CPU each image). Prints the victim's latency before and during.
2. backlog: one client opens 8, then 20 streams on one connection and queues 64 requests of
   the seven built-in photos on each, never reading; another client's one-photo request
   then. Prints how long that request took (the streams are cancelled after).
3. memory: a stream that sends requests and never reads its answers, in three shapes (1 MiB
   request ids; 256 undecodable images per request; 60 MB requests). Prints how much the
   ingress process' resident memory grew (read from /proc: the server must run here).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import time
from pathlib import Path

import grpc
import numpy as np
from load import builtin_photos
from PIL import Image
from skimage import data

from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

MESSAGE_BYTES = 64 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MESSAGE_BYTES),
]


def _jpeg(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _bomb_png() -> bytes:
    """16-bit greyscale, 6324x6324 (under the default 40 M pixel limit), ~100 KB."""
    row = (np.arange(6324, dtype=np.uint32) * 10 % 65536).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(np.tile(row, (6324, 1))).save(buffer, "PNG")
    return buffer.getvalue()


async def _victim(address: str, photo: bytes, until: asyncio.Event) -> list[float]:
    """One-photo ClassifyOnce calls, one at a time, until `until` is set: latencies in ms."""
    latencies = []
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        once = pb_grpc.ImageClassifierStub(channel).ClassifyOnce
        while not until.is_set():
            start = time.perf_counter()
            answer = await once(pb.ClassifyRequest(images=[photo]), timeout=120)
            assert answer.error.code == 0, answer.error
            latencies.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(0.05)
    return latencies


async def fairness(address: str) -> None:
    photo = _jpeg(data.chelsea())
    calm = asyncio.Event()
    baseline = asyncio.ensure_future(_victim(address, photo, calm))
    await asyncio.sleep(3)
    calm.set()
    before = await baseline
    bomb = _bomb_png()
    done = asyncio.Event()
    during = asyncio.ensure_future(_victim(address, photo, done))
    start = time.perf_counter()
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        requests = [pb.ClassifyRequest(request_id=str(i), images=[bomb] * 32) for i in range(2)]
        answers = [a async for a in pb_grpc.ImageClassifierStub(channel).Classify(iter(requests))]
    attack_s = time.perf_counter() - start
    done.set()
    latencies = await during
    codes = sorted({r.error.code for a in answers for r in a.results} | {answers[0].error.code})
    print(
        f"fairness: one photo alone p50 {statistics.median(before):.0f} ms, max "
        f"{max(before):.0f} ms; during the attack ({attack_s:.1f} s, image codes {codes}) "
        f"p50 {statistics.median(latencies):.0f} ms, max {max(latencies):.0f} ms over "
        f"{len(latencies)} calls"
    )


async def backlog(address: str, streams: int) -> None:
    photos = builtin_photos()
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        stub = pb_grpc.ImageClassifierStub(channel)
        calls = [stub.Classify() for _ in range(streams)]
        for call in calls:
            for i in range(64):
                await call.write(pb.ClassifyRequest(request_id=str(i), images=photos))
        async with grpc.aio.insecure_channel(address, options=OPTIONS) as other:
            start = time.perf_counter()
            answer = await pb_grpc.ImageClassifierStub(other).ClassifyOnce(
                pb.ClassifyRequest(images=[photos[0]]), timeout=300
            )
            took = time.perf_counter() - start
        for call in calls:
            call.cancel()
    print(
        f"backlog: {streams} streams x 64 requests of {len(photos)} photos queued, unread; "
        f"another client's one-photo request answered (code {answer.error.code}) after "
        f"{took:.1f} s"
    )
    await asyncio.sleep(5)  # the cancelled streams' calls in flight end


def _ingress_rss_bytes() -> int:
    """Resident memory of the ingress replica process(es) on this machine."""
    total = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"ServeReplica" in (args := cmdline.read_bytes()) and b"Ingress" in args:
                status = (cmdline.parent / "status").read_text()
                total += int(status.split("VmRSS:")[1].split()[0]) * 1024
        except (OSError, IndexError):
            continue
    return total


async def memory(address: str, name: str, request: pb.ClassifyRequest, count: int) -> None:
    before = _ingress_rss_bytes()
    peak = before

    async def requests():
        for i in range(count):
            request.request_id = request.request_id[:-8] + f"{i:08d}"
            yield request

    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        call = pb_grpc.ImageClassifierStub(channel).Classify(requests())
        for _ in range(60):  # 30 s of not reading
            await asyncio.sleep(0.5)
            peak = max(peak, _ingress_rss_bytes())
        call.cancel()
    print(
        f"memory, {name}: ingress RSS {before / 1e6:.0f} MB before, peak {peak / 1e6:.0f} MB "
        f"(+{(peak - before) / 1e6:.0f} MB) while a stream sent {count} requests unread"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:9000")
    parser.add_argument("--only", default="fairness,backlog,memory", help="checks, in turn")
    args = parser.parse_args()
    address, checks = args.address, args.only.split(",")
    if "fairness" in checks:
        await fairness(address)
    if "backlog" in checks:
        for streams in (8, 20):
            await backlog(address, streams)
    if "memory" not in checks:
        return
    junk = np.random.default_rng(0).bytes(4096)
    await memory(address, "1 MiB request ids", pb.ClassifyRequest(request_id="x" * (1 << 20)), 5000)
    bad = pb.ClassifyRequest(request_id="x" * 16, images=[junk] * 256)
    await memory(address, "256 undecodable images per request", bad, 5000)
    big = pb.ClassifyRequest(request_id="x" * 16, images=[junk * 256] * 60)
    await memory(address, "60 MB requests", big, 200)


if __name__ == "__main__":
    asyncio.run(main())
