"""Load generator for raystream (`raystream bench`): concurrent bidi streams or unary calls,
closed-loop (fixed requests in flight per stream) or open-loop (Poisson arrivals at a target
rate), reporting throughput, latency percentiles, errors by code and the server's own timing
breakdown. `sweep()` runs a series of loads for a latency/throughput curve, and
`in_process_baseline()` runs the same work without gRPC or Ray, so a report can print
"server / in-process" from one run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import itertools
import multiprocessing
import random
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np

from clients.client import DIALS_PER_REPLICA, Client, EncodedRequest, status_name
from raystream.v1 import classifier_pb2 as pb

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Workload:
    images: tuple[bytes, ...]  # cycled through
    batch_size: int = 8  # images per request
    streams: int = 1
    in_flight: int = 1  # closed loop: outstanding requests per stream
    rate: float | None = None  # open loop: requests/s over all streams (Poisson)
    duration_s: float = 10.0
    max_requests: int | None = None  # per stream
    unary: bool = False
    top_k: int = 5
    # TCP connections the streams are spread over; above 1, each goes to another ingress
    # replica in turn (see find_replicas), as many as there are up to this number.
    connections: int = 1
    # Each stream spreads its requests over all of its process' connections (one
    # Client(connections=N)) instead of keeping to one: one long-lived stream reaching
    # several `direct` replicas.
    spread: bool = False
    # Send the model input instead of the images: float32 (N, C, H, W) rows, cycled through
    # (model_input makes them from the images), as a client that preprocesses itself does.
    pixels: np.ndarray | None = field(default=None, compare=False)


@dataclass
class Report:
    images_per_s: float
    requests_per_s: float
    requests: int
    latency_ms: dict[str, float]  # p50, p90, p95, p99, max, mean
    errors: dict[str, int]  # gRPC code name -> requests or images with that error
    server_ms: dict[str, float]  # mean queue / preprocess / inference / postprocess / total
    mean_batch_size: float
    # p50 / p99 of the server's own total per request (Timing.total_ms): the rest of the
    # end-to-end latency is the network and the client, this process included
    server_total_ms: dict[str, float] = field(default_factory=dict)
    offered: dict = field(default_factory=dict)

    def line(self) -> str:
        lat = self.latency_ms
        return (
            f"{self.images_per_s:9.1f} img/s {self.requests_per_s:8.1f} req/s  p50 "
            f"{lat['p50']:7.2f}  p90 {lat['p90']:7.2f}  p99 {lat['p99']:7.2f}  max "
            f"{lat['max']:7.2f} ms  (server p99 {self.server_total_ms.get('p99', 0):6.2f})  "
            f"batch {self.mean_batch_size:5.1f}  errors {self.errors or 0}"
        )


def builtin_photos() -> tuple[bytes, ...]:
    """Real photos from scikit-image as JPEG bytes (451x300 to 1000x872)."""
    from PIL import Image
    from skimage import data

    photos = [
        data.chelsea(),
        data.coffee(),
        data.astronaut(),
        data.rocket(),
        data.hubble_deep_field(),
        data.immunohistochemistry(),
        data.stereo_motorcycle()[0],
    ]
    out = []
    for photo in photos:
        buffer = io.BytesIO()
        Image.fromarray(photo).convert("RGB").save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return tuple(out)


def folder_images(folder: Path) -> tuple[bytes, ...]:
    from engines.calibration import IMAGE_SUFFIXES

    paths = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise FileNotFoundError(f"no images under {folder}")
    return tuple(p.read_bytes() for p in paths)


class _Recorder:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.server: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.server_totals: list[float] = []
        self.batch_sizes: list[int] = []
        self.images = 0

    def record(self, sent: float, response: pb.ClassifyResponse) -> None:
        self.latencies.append((time.perf_counter() - sent) * 1000.0)
        if response.error.code:
            self.errors[status_name(response.error.code)] += 1
            return
        for result in response.results:
            if result.error.code:
                self.errors[status_name(result.error.code)] += 1
        self.images += len(response.results)
        t = response.timing
        for key in ("queue_ms", "preprocess_ms", "inference_ms", "postprocess_ms", "total_ms"):
            self.server[key] += getattr(t, key)
        self.server_totals.append(t.total_ms)
        self.batch_sizes.append(t.batch_size)

    def merge(self, other: _Recorder) -> None:
        self.latencies += other.latencies
        self.errors.update(other.errors)
        for key, value in other.server.items():
            self.server[key] += value
        self.server_totals += other.server_totals
        self.batch_sizes += other.batch_sizes
        self.images += other.images


async def _requests(
    workload: Workload,
    sent: dict[str, float],
    slots: asyncio.Semaphore | None,
    deadline: float,
    prefix: str,
    rng: random.Random,
) -> AsyncIterator[EncodedRequest]:
    # Each image (or the pixels) is encoded once, each request's id and top_k anew, and the
    # pieces joined: a fifth of this process' CPU went to building and serializing messages
    # that differ only in their id.
    if workload.pixels is None:  # images: cycled through, batch_size a request
        images = itertools.cycle(
            [pb.ClassifyRequest(images=[image]).SerializeToString() for image in workload.images]
        )
        bodies = (tuple(itertools.islice(images, workload.batch_size)) for _ in itertools.count())
    else:  # one tensor of batch_size rows, sent by every request
        rows = np.resize(workload.pixels, (workload.batch_size, *workload.pixels.shape[1:]))
        tensor = pb.Tensor(shape=rows.shape, data=rows.astype("<f4").tobytes())
        bodies = itertools.repeat((pb.ClassifyRequest(pixels=tensor).SerializeToString(),))
    per_stream_rate = workload.rate / workload.streams if workload.rate else None
    next_at = time.perf_counter()
    for i in itertools.count():
        if workload.max_requests is not None and i >= workload.max_requests:
            return
        if per_stream_rate:
            next_at += rng.expovariate(per_stream_rate)
            if next_at >= deadline:  # do not sleep past the end (it would count as run time)
                return
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        else:
            await slots.acquire()
        if time.perf_counter() >= deadline:
            return
        request_id = f"{prefix}-{i}"
        head = pb.ClassifyRequest(request_id=request_id, top_k=workload.top_k)
        sent[request_id] = time.perf_counter()
        yield EncodedRequest(request_id, b"".join((head.SerializeToString(), *next(bodies))))


async def _one_stream(
    client: Client, workload: Workload, recorder: _Recorder, deadline: float, index: int
) -> None:
    sent: dict[str, float] = {}
    slots = None if workload.rate else asyncio.Semaphore(workload.in_flight)
    rng = random.Random(index)
    requests = _requests(workload, sent, slots, deadline, f"s{index}", rng)
    if workload.unary:

        async def worker() -> None:
            async for request in requests:
                response = await client.classify_once(request)
                recorder.record(sent.pop(request.request_id), response)
                if slots:
                    slots.release()

        await worker()
        return
    try:
        async for response in client.stream(requests):
            recorder.record(sent.pop(response.request_id), response)
            if slots:
                slots.release()
    except grpc.aio.AioRpcError:
        pass  # every unanswered request was recorded with the stream's status code above


async def run_load(
    address: str, workload: Workload, processes: int = 1, **client_options: object
) -> Report:
    """Run `workload` against `address`; `client_options` go to Client (token, TLS).

    With `processes` > 1 the streams (and the rate) are split over that many load-generator
    processes that start sending at the same moment: one Python process tops out at a few
    thousand images/s, below what a GPU server takes."""
    replicas = await find_replicas(address, workload.connections, client_options)
    if processes <= 1:
        recorder, elapsed = await _record_load(
            address, workload, None, (0, 0), replicas, client_options
        )
        return _report(recorder, elapsed, workload, replicas)
    if workload.streams < processes:
        raise ValueError(f"--processes {processes} needs at least as many streams")
    streams = [len(range(i, workload.streams, processes)) for i in range(processes)]
    shares = [
        replace(
            workload,
            streams=n,
            rate=workload.rate * n / workload.streams if workload.rate else None,
            connections=max(1, len(range(i, workload.connections, processes))),
        )
        for i, n in enumerate(streams)
    ]
    # Global stream numbers (distinct request ids and arrival seeds per process) and
    # connection numbers (which replica each connection goes to).
    firsts = zip(
        itertools.accumulate(streams, initial=0),
        itertools.accumulate((share.connections for share in shares), initial=0),
        strict=False,
    )
    start_at = time.time() + 5.0 + 0.5 * processes  # after every process has connected
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        results = await asyncio.gather(
            *(
                loop.run_in_executor(
                    pool, _load_process, address, share, start_at, first, replicas, client_options
                )
                for share, first in zip(shares, firsts, strict=False)
            )
        )
    merged = _Recorder()
    for recorder, _ in results:
        merged.merge(recorder)
    report = _report(merged, max(elapsed for _, elapsed in results), workload, replicas)
    report.offered["processes"] = processes
    return report


def _load_process(
    address: str,
    workload: Workload,
    start_at: float,
    firsts: tuple[int, int],
    replicas: list[str],
    client_options: dict,
) -> tuple[_Recorder, float]:
    return asyncio.run(_record_load(address, workload, start_at, firsts, replicas, client_options))


async def find_replicas(address: str, count: int, client_options: dict) -> list[str]:
    """Up to `count` of the ingress replicas behind `address` (none when `count` is 1).

    Replicas share the port (SO_REUSEPORT) and the kernel hashes each connection to one of
    them, so a few connections often miss some: 4 connections reached 2 or 3 of 4 replicas
    on the H200. Each new connection asks where it landed."""
    found: set[str] = set()
    for _ in range(DIALS_PER_REPLICA * count if count > 1 else 0):
        async with Client(address, **client_options) as client:
            await client.wait_ready(timeout=30)
            found.add(await client.replica())
        if len(found - {""}) >= count:
            break
    return sorted(found - {""})


async def _connect(address: str, replica: str | None, dials: int, options: dict) -> Client:
    """A ready client on `replica` (None: wherever the kernel puts it), dialing up to `dials`
    times; the last dial is kept wherever it landed. Its streams keep to that connection (no
    reconnect): one that fails shows in the report as errors, and costs what it did."""
    for dial in range(1, dials + 1):
        client = Client(address, reconnect=False, **options)
        await client.__aenter__()
        try:
            await client.wait_ready(timeout=30)
            if replica is None or dial == dials or await client.replica() == replica:
                return client
        except BaseException:
            await client.close()
            raise
        await client.close()
    raise ValueError("dials must be at least 1")


async def _record_load(
    address: str,
    workload: Workload,
    start_at: float | None,
    firsts: tuple[int, int],
    replicas: list[str],
    client_options: dict,
) -> tuple[_Recorder, float]:
    """`firsts`: the global numbers of this process' first stream and first connection;
    connection n goes to replicas[n % len(replicas)] (anywhere if `replicas` is empty)."""
    first_stream, first_connection = firsts
    recorder = _Recorder()
    dials = DIALS_PER_REPLICA * max(1, len(replicas))
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        if workload.spread:  # one client over this process' connections, each stream on all
            pool = Client(address, connections=workload.connections, **client_options)
            clients.append(await stack.enter_async_context(pool))
        else:
            for n in range(first_connection, first_connection + workload.connections):
                replica = replicas[n % len(replicas)] if replicas else None
                clients.append(await _connect(address, replica, dials, client_options))
                stack.push_async_callback(clients[-1].close)
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.perf_counter()
        deadline = start + workload.duration_s
        await asyncio.gather(
            *(
                _one_stream(
                    clients[i % len(clients)], workload, recorder, deadline, first_stream + i
                )
                for i in range(workload.streams)
            )
        )
        elapsed = time.perf_counter() - start
    return recorder, elapsed


def _report(recorder: _Recorder, elapsed: float, workload: Workload, replicas: list[str]) -> Report:
    lat = np.asarray(recorder.latencies or [0.0])
    count = max(1, len(recorder.batch_sizes))
    offered = {k: v for k, v in asdict(workload).items() if k not in ("images", "pixels")}
    offered["input"] = "images" if workload.pixels is None else "pixels"
    offered["ingress_replicas"] = len(replicas) or None  # None: not looked for (1 connection)
    return Report(
        images_per_s=recorder.images / elapsed,
        requests_per_s=len(recorder.latencies) / elapsed,
        requests=len(recorder.latencies),
        latency_ms={
            **{f"p{p}": float(np.percentile(lat, p)) for p in PERCENTILES},
            "max": float(lat.max()),
            "mean": float(lat.mean()),
        },
        errors=dict(recorder.errors),
        server_ms={k: v / count for k, v in recorder.server.items()},
        mean_batch_size=float(np.mean(recorder.batch_sizes or [0])),
        offered=offered,
        server_total_ms={
            f"p{p}": float(np.percentile(recorder.server_totals, p))
            for p in (50, 99)
            if recorder.server_totals
        },
    )


def in_process_baseline(
    repository: Path,
    model: str,
    engine_kind: str,
    images: tuple[bytes, ...],
    batch_size: int,
    duration_s: float,
    threads: int = 2,
    **engine_options: object,
) -> dict[str, float]:
    """The same work without gRPC or Ray, images/s at `batch_size`: decode (in `threads`
    threads) + engine, the engine alone on decoded uint8 crops, and the engine alone on
    float32 input (what a `pixels` request runs)."""
    from concurrent.futures import ThreadPoolExecutor

    from engines import create_engine
    from engines.base import normalize
    from engines.images import decode
    from engines.repository import resolve

    ref = resolve(repository, model)
    spec = ref.spec.preprocess
    mean, std = spec.mean_array, spec.std_array
    batch = [images[i % len(images)] for i in range(batch_size)]
    with (
        create_engine(
            engine_kind, ref, max_batch_size=max(batch_size, 1), **engine_options
        ) as engine,
        ThreadPoolExecutor(threads) as pool,
    ):
        engine.warmup()
        crops = np.stack(list(pool.map(lambda d: decode(d, spec), batch)))
        engine_only = _rate(lambda: engine.infer_uint8(crops, mean, std), batch_size, duration_s)
        pixels = normalize(crops, mean, std)
        engine_fp32 = _rate(lambda: engine.infer(pixels), batch_size, duration_s)
        full = _rate(
            lambda: engine.infer_uint8(
                np.stack(list(pool.map(lambda d: decode(d, spec), batch))), mean, std
            ),
            batch_size,
            duration_s,
        )
    return {
        "decode_and_engine_images_per_s": full,
        "engine_images_per_s": engine_only,
        "engine_fp32_images_per_s": engine_fp32,
    }


def model_input(repository: Path, model: str, images: tuple[bytes, ...]) -> np.ndarray:
    """`images` preprocessed as the server would (the model's spec in `repository`):
    float32 (N, C, H, W), what a client that preprocesses itself sends as `pixels`."""
    from engines.base import normalize
    from engines.images import decode
    from engines.repository import resolve

    spec = resolve(repository, model).spec.preprocess
    crops = np.stack([decode(image, spec) for image in images])
    return normalize(crops, spec.mean_array, spec.std_array)


def _rate(fn, batch_size: int, duration_s: float) -> float:
    fn()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < duration_s:
        fn()
        count += 1
    return count * batch_size / (time.perf_counter() - start)


def plot_sweep(reports: list[Report], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = [r.images_per_s for r in reports]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in ("p50", "p90", "p99"):
        ax.plot(throughput, [r.latency_ms[key] for r in reports], marker="o", label=key)
    ax.set_xlabel("throughput (images/s)")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
