"""A plain grpcio load generator for raystream.v1.ImageClassifier: what a client in any
language gets, with no raystream client code (it imports grpc, the generated stubs, numpy,
PIL and scikit-image only).

    python bench/load.py --target 127.0.0.1:9000 --connections 4 --in-flight 2 --images 8
    python bench/load.py --target HOST:PORT --connections 32 --rate 5000 --images 8 \
        --processes 2 --duration 10 --warmup 2 --json out.json
    python bench/load.py --target 127.0.0.1:9000 --connections 4 --outputs labels,embedding

Model: N TCP connections, each its own grpc.aio channel (a local subchannel pool and a
channel argument of its own, so no two channels share a connection), each carrying one
`Classify` bidi stream (or, with --unary, `ClassifyOnce` calls). Closed loop: each
connection keeps M requests in flight. Open loop (--rate IMG/S): requests arrive as a
Poisson process at that total image rate, split evenly over the connections; latency is
still measured from the write, and `send_lag_ms` says how far writes fell behind schedule.
Requests carry K JPEG photos (seven scikit-image photos at quality 90, cycled, or
--photos DIR; with --repeat-fraction F each image is, with probability F, one of a fixed set
of those photos, else a photo made unique, so a server's result cache sees repeats at that
rate) and ask for --outputs (labels, embedding, or both; an image answered OK without
an output it asked for counts as an error, `outputs_missing`). --processes P runs the
connections from P processes (one Python process sends at most ~15-20k img/s) and merges
their results.

Sending starts in every process at one shared instant, runs for --warmup then --duration
seconds, and stops; the rest is drained (--drain). Only answers that arrive within the
--duration window count in img/s, req/s and latency; status codes and the exactly-one-answer
check cover the whole run. img/s counts images answered without an error.

Prints a one-line summary, then the JSON report (or writes it to --json). With
--announce-window it first prints `window START END` (Unix times) as soon as the window is
fixed, for a runner that measures the server over the same window.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import multiprocessing
import random
import struct
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

try:
    from raystream.v1 import classifier_pb2 as pb
    from raystream.v1 import classifier_pb2_grpc as pb_grpc
except ImportError:  # a checkout that is not installed: the stubs live under protos/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protos"))
    from raystream.v1 import classifier_pb2 as pb
    from raystream.v1 import classifier_pb2_grpc as pb_grpc

PHOTOS = ("chelsea", "coffee", "astronaut", "rocket", "camera", "coins", "hubble_deep_field")
SERVICE = pb.DESCRIPTOR.services_by_name["ImageClassifier"].full_name
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
OUTPUTS = {"labels": pb.LABELS, "embedding": pb.EMBEDDING}


@dataclass(frozen=True)
class LoadSpec:
    target: str
    connections: int = 1
    in_flight: int = 1  # closed loop: requests outstanding per connection
    images: int = 8  # per request
    unary: bool = False
    rate: float | None = None  # open loop: images/s over all connections (Poisson)
    duration: float = 10.0
    warmup: float = 2.0
    processes: int = 1
    top_k: int = 5
    timeout_ms: int = 0  # per-request deadline carried in the request; 0: none
    drain: float = 30.0  # seconds after sending stops to wait for the last answers
    seed: int = 0
    outputs: str = "labels"  # comma-separated: labels, embedding (ClassifyRequest.outputs)
    pixels: int = 0  # > 0: send `pixels` (zeros, images x 3 x P x P float32), no photos
    # None: the photos cycled (every request repeats them). A fraction: each image is, with
    # this probability, one of a fixed set (a variant of each photo, the same in every
    # connection and run), else a photo made unique (`unique_variant`): cache hit rates.
    repeat_fraction: float | None = None
    # None: no W3C traceparent. N >= 0: every call carries one, sampled on the first N
    # connections and unsampled on the others. A server with tracing on keeps a sampled
    # parent always and an unsampled one never, so it traces N/connections of the requests
    # (closed loop: the connections go at one pace), and one running server compares them.
    traced_connections: int | None = None

    def traceparent(self, connection: int) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata of `connection`'s calls."""
        if self.traced_connections is None:
            return ()
        ids = random.Random(f"{self.seed}-{connection}")
        flags = "01" if connection < self.traced_connections else "00"
        trace_id, span_id = ids.getrandbits(128) | 1, ids.getrandbits(64) | 1
        return (("traceparent", f"00-{trace_id:032x}-{span_id:016x}-{flags}"),)

    def wanted(self) -> tuple[bool, bool]:
        """(labels, embedding) each request asks for."""
        names = {name.strip() for name in self.outputs.split(",") if name.strip()}
        unknown = names - set(OUTPUTS)
        if unknown or not names:
            raise ValueError(f"outputs must name {' and/or '.join(OUTPUTS)}, got {self.outputs!r}")
        return "labels" in names, "embedding" in names

    def describe(self) -> str:
        kind = "unary" if self.unary else "stream"
        loop = f"open loop {self.rate:g} img/s" if self.rate else f"{self.in_flight} in flight"
        asked = "" if self.outputs == "labels" else f", outputs {self.outputs}"
        if self.repeat_fraction is not None:
            asked += f", {self.repeat_fraction:g} repeated"
        if self.traced_connections is not None:
            asked += f", traceparent sampled on {self.traced_connections}"
        return f"{self.connections} conn x {loop}, {self.images} img/request, {kind}{asked}"


def builtin_photos(quality: int = 90) -> list[bytes]:
    """The seven scikit-image photos (300x451 to 872x1000; camera and coins grey) as JPEGs."""
    from PIL import Image
    from skimage import data

    out = []
    for name in PHOTOS:
        buffer = io.BytesIO()
        Image.fromarray(np.asarray(getattr(data, name)())).save(buffer, "JPEG", quality=quality)
        out.append(buffer.getvalue())
    return out


def folder_photos(folder: Path) -> list[bytes]:
    suffixes = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in suffixes)
    if not paths:
        raise SystemExit(f"no images under {folder}")
    return [p.read_bytes() for p in paths]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def unique_variant(photo: bytes, tag: bytes) -> list[bytes]:
    """`photo` with `tag` where decoders skip it (as pieces to join): a JPEG gets a comment
    segment after its start-of-image marker, so it still ends with its end-of-image marker
    (which nvJPEG wants) and decodes to the same pixels; other formats get it appended."""
    if photo[:2] == b"\xff\xd8":
        return [b"\xff\xd8\xff\xfe", struct.pack(">H", len(tag) + 2), tag, memoryview(photo)[2:]]
    return [photo, tag]


class _Requests:
    """Serialized ClassifyRequests for one connection: the images, top_k and timeout_ms are
    serialized once per starting photo, and each request prepends its own request_id (field
    1), which gives the same bytes as SerializeToString() on the whole message."""

    def __init__(self, spec: LoadSpec, photos: list[bytes], connection: int) -> None:
        n, k = len(photos), spec.images
        labels, embedding = spec.wanted()
        # labels alone is the default: sent as no `outputs`, the bytes of any older client
        outputs = [] if not embedding else [OUTPUTS["labels"]] * labels + [OUTPUTS["embedding"]]
        pixels = None
        if spec.pixels:  # the model input itself: the server decodes nothing
            shape = (k, 3, spec.pixels, spec.pixels)
            pixels = pb.Tensor(shape=shape, data=bytes(4 * k * 3 * spec.pixels**2))
        self._tails = [
            pb.ClassifyRequest(
                images=[] if pixels else [photos[(start + j) % n] for j in range(k)],
                pixels=pixels,
                top_k=spec.top_k,
                timeout_ms=spec.timeout_ms,
                outputs=outputs,
            ).SerializeToString()
            for start in range(n)
        ]
        self._prefix, self._n, self._k = f"c{connection}-", n, k
        self._start = connection * k  # connections start at different photos
        self._seq = 0
        self._fraction = spec.repeat_fraction
        if self._fraction is not None:
            self._photos = photos
            self._rng = random.Random(spec.seed * 100_003 + connection)
            self._repeats = [
                self._entry(unique_variant(photo, f"raystream-bench repeat {i}".encode()))
                for i, photo in enumerate(photos)
            ]
            self._tail = pb.ClassifyRequest(
                top_k=spec.top_k, timeout_ms=spec.timeout_ms, outputs=outputs
            ).SerializeToString()
            self._nonce = f"raystream-bench {uuid.uuid4().hex} {connection} ".encode()

    @staticmethod
    def _entry(pieces: list[bytes]) -> bytes:
        """A ClassifyRequest `images` entry (field 2) of the joined pieces."""
        size = sum(len(piece) for piece in pieces)
        return b"".join([b"\x12", _varint(size), *pieces])

    def next(self) -> tuple[str, bytes]:
        seq = self._seq
        self._seq += 1
        rid = f"{self._prefix}{seq}"
        first = self._start + seq * self._k
        if self._fraction is None:
            tail = self._tails[first % self._n]
            return rid, b"\n" + bytes((len(rid),)) + rid.encode() + tail
        pieces = [b"\n" + bytes((len(rid),)) + rid.encode()]
        rng = self._rng
        for j in range(self._k):
            if rng.random() < self._fraction:
                pieces.append(rng.choice(self._repeats))
            else:
                photo = self._photos[(first + j) % self._n]
                variant = unique_variant(photo, self._nonce + b"%d %d" % (seq, j))
                size = sum(len(piece) for piece in variant)
                pieces += [b"\x12", _varint(size), *variant]
        pieces.append(self._tail)
        return rid, b"".join(pieces)


# The server's own account of a request (its answer's `timing`), averaged over the answers
# in the window: where the time of a request goes inside the server.
TIMING = ("total", "dispatch", "queue", "preprocess", "inference", "postprocess")


class _Stats:
    """One process' counts; merged across processes by `merge`."""

    def __init__(self, window: tuple[float, float], wanted: tuple[bool, bool]) -> None:
        self.window = window
        self._labels, self._embedding = wanted
        self.latencies: list[float] = []  # seconds, answers within the window
        self.lags: list[float] = []  # open loop: write time - scheduled time, in the window
        self.window_requests = self.window_images = self.window_ok_images = 0
        self.sent = self.answered = self.missing = self.duplicates = self.unknown = 0
        self.outputs_missing = 0  # images answered OK without an output they asked for
        self.request_codes: collections.Counter[int] = collections.Counter()
        self.image_codes: collections.Counter[int] = collections.Counter()
        self.rpc_codes: collections.Counter[int] = collections.Counter()
        self.client_cpu_s = 0.0
        self.timed = 0  # OK answers in the window, whose `timing` is summed here:
        self.timing_sums = dict.fromkeys(TIMING, 0.0)
        self.timings: list[tuple[float, ...]] = []  # ... and kept, in seconds (for the tails)
        self._answered: set[str] = set()

    def answer(self, response: pb.ClassifyResponse, now: float, outstanding: dict) -> None:
        rid = response.request_id
        sent = outstanding.pop(rid, None)
        if sent is None:
            if rid in self._answered:
                self.duplicates += 1
            else:
                self.unknown += 1
            return
        self._answered.add(rid)
        self.answered += 1
        self.request_codes[response.error.code] += 1
        ok = total = 0
        for result in response.results:
            code = result.error.code
            self.image_codes[code] += 1
            total += 1
            ok += not code
            if not code and (
                (self._labels and not result.labels)
                or (self._embedding and not result.HasField("embedding"))
            ):
                self.outputs_missing += 1
        if self._count(now, sent, total, ok) and not response.error.code:
            self.timed += 1
            times = tuple(getattr(response.timing, f"{name}_ms") / 1000.0 for name in TIMING)
            for name, seconds in zip(TIMING, times, strict=True):
                self.timing_sums[name] += seconds * 1000.0
            self.timings.append(times)

    def failed_call(self, code: int, now: float, sent: float) -> None:
        """A unary call that ended with a non-OK status: its answer."""
        self.answered += 1
        self.rpc_codes[code] += 1
        self._count(now, sent, 0, 0)

    def _count(self, now: float, sent: float, images: int, ok: int) -> bool:
        """Counts an answer that came in the window; whether it did."""
        if not self.window[0] <= now <= self.window[1]:
            return False
        self.latencies.append(now - sent)
        self.window_requests += 1
        self.window_images += images
        self.window_ok_images += ok
        return True

    def result(self) -> dict:
        out = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return out


async def _poisson(rate: float, rng: random.Random, start: float, end: float, stats: _Stats):
    """Yields once per arrival of a Poisson process at `rate`/s between start and end."""
    due = start
    while True:
        due += rng.expovariate(rate)
        if due >= end:
            return
        delay = due - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.time()
        if now >= stats.window[0]:
            stats.lags.append(now - due)
        yield


async def _stream(spec, channel, requests, stats, start, rng, metadata) -> None:
    """One Classify stream: closed loop (in_flight outstanding) or open loop (Poisson)."""
    send_end = stats.window[1]
    call = channel.stream_stream(
        f"/{SERVICE}/Classify", response_deserializer=pb.ClassifyResponse.FromString
    )(metadata=metadata)
    outstanding: dict[str, float] = {}
    window = asyncio.Semaphore(spec.in_flight)
    reading = True

    async def send(rid: str, data: bytes) -> None:
        outstanding[rid] = time.time()
        stats.sent += 1
        await call.write(data)

    async def write() -> None:
        try:
            if spec.rate:
                per_connection = spec.rate / spec.images / spec.connections
                async for _ in _poisson(per_connection, rng, start, send_end, stats):
                    await send(*requests.next())
            else:
                while True:
                    await window.acquire()
                    if time.time() >= send_end or not reading:
                        break
                    await send(*requests.next())
            await call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the stream ended: read() records its status

    async def read() -> None:
        nonlocal reading
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                stats.answer(response, time.time(), outstanding)
                window.release()
            code = await call.code()
            if code != grpc.StatusCode.OK:
                stats.rpc_codes[code.value[0]] += 1
        except grpc.aio.AioRpcError as exc:
            stats.rpc_codes[exc.code().value[0]] += 1
        finally:
            reading = False
            for _ in range(spec.in_flight):  # a writer waiting for room must see the end
                window.release()

    writer, reader = asyncio.create_task(write()), asyncio.create_task(read())
    try:
        await asyncio.wait_for(reader, max(send_end + spec.drain - time.time(), 1.0))
    except TimeoutError:
        call.cancel()
    writer.cancel()
    stats.missing += len(outstanding)


async def _unary(spec, channel, requests, stats, start, rng, metadata) -> None:
    """ClassifyOnce calls: in_flight callers in a loop, or one call per Poisson arrival."""
    send_end = stats.window[1]
    method = channel.unary_unary(
        f"/{SERVICE}/ClassifyOnce", response_deserializer=pb.ClassifyResponse.FromString
    )

    async def one() -> None:
        rid, data = requests.next()
        sent = time.time()
        outstanding = {rid: sent}
        stats.sent += 1
        try:
            deadline = max(send_end + spec.drain - sent, 1.0)
            response = await method(data, timeout=deadline, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            stats.failed_call(exc.code().value[0], time.time(), sent)
        else:
            stats.answer(response, time.time(), outstanding)
            stats.missing += len(outstanding)  # an answer with another request_id

    async def caller() -> None:
        while time.time() < send_end:
            await one()

    if spec.rate:
        calls = set()
        per_connection = spec.rate / spec.images / spec.connections
        async for _ in _poisson(per_connection, rng, start, send_end, stats):
            task = asyncio.create_task(one())
            calls.add(task)
            task.add_done_callback(calls.discard)
        if calls:
            await asyncio.wait(calls)
    else:
        await asyncio.gather(*(caller() for _ in range(spec.in_flight)))


def _channel(target: str, connection: int) -> grpc.aio.Channel:
    # Channels with equal arguments share subchannels (TCP connections) through gRPC's global
    # pool: a local pool, and an argument that differs per channel, give each its own.
    options = [
        ("grpc.use_local_subchannel_pool", 1),
        ("raystream.bench.connection", connection),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    return grpc.aio.insecure_channel(target, options=options)


async def _process_load(spec: LoadSpec, connections: list[int], photos, pipe) -> dict:
    loop = asyncio.get_running_loop()
    channels = [_channel(spec.target, c) for c in connections]
    try:
        ready = asyncio.gather(*(ch.channel_ready() for ch in channels))
        await asyncio.wait_for(ready, 60)
        requests = [_Requests(spec, photos, c) for c in connections]
        pipe.send(("ready", None))
        start = await loop.run_in_executor(None, pipe.recv)
        window = (start + spec.warmup, start + spec.warmup + spec.duration)
        stats = _Stats(window, spec.wanted())
        cpu = []
        for at in window:
            loop.call_later(max(at - time.time(), 0), lambda: cpu.append(time.process_time()))
        await asyncio.sleep(max(start - time.time(), 0))
        run = _unary if spec.unary else _stream

        def rng(connection: int) -> random.Random:
            return random.Random(spec.seed * 100_003 + connection)

        await asyncio.gather(
            *(
                run(spec, ch, reqs, stats, start, rng(c), spec.traceparent(c))
                for ch, reqs, c in zip(channels, requests, connections, strict=True)
            )
        )
        if len(cpu) == 2:
            stats.client_cpu_s = cpu[1] - cpu[0]
        return stats.result()
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))


def _process_main(spec: LoadSpec, connections: list[int], photos, pipe) -> None:
    try:
        result = asyncio.run(_process_load(spec, connections, photos, pipe))
        pipe.send(("result", result))
    except BaseException as exc:  # the parent reports it
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))


def model_info(target: str) -> dict:
    with grpc.insecure_channel(target) as channel:
        info = pb_grpc.ImageClassifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=30)
    return {"name": info.name, "version": info.version, "engine": info.engine}


def run(spec: LoadSpec, photos: list[bytes], on_window=None) -> dict:
    """Runs `spec` from spec.processes processes; returns the merged report."""
    spec.wanted()  # a bad `outputs` fails here, before any process starts
    if spec.repeat_fraction is not None and not 0.0 <= spec.repeat_fraction <= 1.0:
        raise ValueError(f"repeat_fraction must be in 0..1, got {spec.repeat_fraction}")
    info = model_info(spec.target)
    processes = max(1, min(spec.processes, spec.connections))
    context = multiprocessing.get_context("spawn")
    children = []
    for p in range(processes):
        parent_end, child_end = context.Pipe()
        share = list(range(p, spec.connections, processes))
        child = context.Process(
            target=_process_main, args=(spec, share, photos, child_end), daemon=True
        )
        child.start()
        children.append((child, parent_end))
    try:
        for _, pipe in children:
            if not pipe.poll(120):
                raise RuntimeError("a load process did not connect within 120 s")
            kind, payload = pipe.recv()
            if kind != "ready":
                raise RuntimeError(f"a load process failed: {payload}")
        start = time.time() + 0.5
        window = (start + spec.warmup, start + spec.warmup + spec.duration)
        if on_window is not None:
            on_window(*window)
        for _, pipe in children:
            pipe.send(start)
        results = []
        limit = spec.warmup + spec.duration + spec.drain + 60
        for _, pipe in children:
            if not pipe.poll(max(window[1] + limit - spec.duration - time.time(), 1)):
                raise RuntimeError("a load process did not finish")
            kind, payload = pipe.recv()
            if kind != "result":
                raise RuntimeError(f"a load process failed: {payload}")
            results.append(payload)
    finally:
        for child, _ in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    report = merge(spec, results)
    report["server"] = info
    report["window"] = list(window)
    return report


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ms = np.asarray(values) * 1000.0
    out = {f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}
    return out | {"max": float(ms.max()), "mean": float(ms.mean())}


def _named(counts: collections.Counter) -> dict[str, int]:
    return {CODE_NAMES.get(code, str(code)): n for code, n in sorted(counts.items())}


def merge(spec: LoadSpec, results: list[dict]) -> dict:
    def total(key: str) -> int:
        return sum(r[key] for r in results)

    def counts(key: str) -> collections.Counter:
        merged: collections.Counter[int] = collections.Counter()
        for r in results:
            merged.update(r[key])
        return merged

    ok_images = total("window_ok_images")
    checks = {
        k: total(k)
        for k in ("sent", "answered", "missing", "duplicates", "unknown", "outputs_missing")
    }
    report = {
        "load": asdict(spec),
        "images_per_s": ok_images / spec.duration,
        "requests_per_s": total("window_requests") / spec.duration,
        "images_answered": ok_images,
        "requests_answered": total("window_requests"),
        "latency_ms": _percentiles([x for r in results for x in r["latencies"]]),
        "requests": checks,
        "exactly_once": checks["missing"] == checks["duplicates"] == checks["unknown"] == 0
        and checks["sent"] == checks["answered"],
        "request_codes": _named(counts("request_codes")),
        "image_codes": _named(counts("image_codes")),
        "rpc_codes": _named(counts("rpc_codes")),
        "client_cpu_ms_per_image": sum(r["client_cpu_s"] for r in results)
        * 1000.0
        / max(ok_images, 1),
        "processes": len(results),
    }
    timed = total("timed")
    if timed:
        report["server_timing_ms"] = {
            name: sum(r["timing_sums"][name] for r in results) / timed for name in TIMING
        }
        # the server's own tail, and each stage's: where a slow request spent its time
        timings = [times for r in results for times in r["timings"]]
        report["server_total_ms"] = _percentiles([times[0] for times in timings])
        report["server_timing_p99_ms"] = {
            name: _percentiles([times[i] for times in timings])["p99"]
            for i, name in enumerate(TIMING)
        }
    if spec.rate:
        report["offered_images_per_s"] = spec.rate
        report["send_lag_ms"] = _percentiles([x for r in results for x in r["lags"]])
    return report


def errors(report: dict) -> dict[str, int]:
    """Every non-OK outcome of the run: request-level, image-level, RPC status, and breaches
    of exactly one answer per request."""
    out: collections.Counter[str] = collections.Counter()
    for level in ("request", "image", "rpc"):
        for name, n in report[f"{level}_codes"].items():
            if name != "OK":
                out[f"{level} {name}"] += n
    for key in ("missing", "duplicates", "unknown", "outputs_missing"):
        if report["requests"].get(key):
            out[key] += report["requests"][key]
    return dict(out)


def summary(report: dict) -> str:
    spec = LoadSpec(**report["load"])
    lat = report["latency_ms"] or dict.fromkeys(("p50", "p90", "p99", "max"), float("nan"))
    once = "exactly one answer each" if report["exactly_once"] else "NOT exactly one answer each"
    lag = report.get("send_lag_ms", {}).get("p99")
    timing = report.get("server_timing_ms")
    server = report.get("server_total_ms", {})
    return (
        f"{spec.describe()}, {report['processes']} process(es), {spec.duration:g} s: "
        f"{report['images_per_s']:.1f} img/s {report['requests_per_s']:.1f} req/s, latency ms "
        f"p50 {lat['p50']:.2f} p90 {lat['p90']:.2f} p99 {lat['p99']:.2f} max {lat['max']:.2f}"
        + (f", send lag p99 {lag:.2f} ms" if lag is not None else "")
        + (
            "; server's mean ms: "
            + ", ".join(f"{name} {timing[name]:.1f}" for name in TIMING)
            + f" (total p50 {server['p50']:.1f} p99 {server['p99']:.1f})"
            if timing and server
            else ""
        )
        + f"; errors {errors(report) or 'none'}; {report['requests']['sent']} requests, {once}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:9000", help="host:port")
    parser.add_argument("--connections", type=int, default=1, help="TCP connections")
    parser.add_argument("--in-flight", type=int, default=1, help="closed loop, per connection")
    parser.add_argument("--images", type=int, default=8, help="images per request")
    parser.add_argument("--unary", action="store_true", help="ClassifyOnce calls, no streams")
    parser.add_argument("--rate", type=float, help="open loop: images/s over all connections")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before, not counted")
    parser.add_argument("--processes", type=int, default=1, help="load-generator processes")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--timeout-ms", type=int, default=0, help="per-request deadline")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds for late answers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--outputs", default="labels", help="what each image asks for: labels, embedding or both"
    )
    parser.add_argument("--photos", type=Path, help="folder of images (default: built-in)")
    parser.add_argument(
        "--pixels", type=int, default=0, help="send P x P model input (zeros), not photos"
    )
    parser.add_argument(
        "--repeat-fraction",
        type=float,
        help="each image repeats one of a fixed set with this probability, else is unique",
    )
    parser.add_argument(
        "--traced-connections",
        type=int,
        help="every call sends a W3C traceparent, sampled on this many connections",
    )
    parser.add_argument("--json", type=Path, help="write the report here, not to stdout")
    parser.add_argument("--announce-window", action="store_true", help="print `window S E`")
    args = parser.parse_args()
    spec = LoadSpec(
        target=args.target,
        connections=args.connections,
        in_flight=args.in_flight,
        images=args.images,
        unary=args.unary,
        rate=args.rate,
        duration=args.duration,
        warmup=args.warmup,
        processes=args.processes,
        top_k=args.top_k,
        timeout_ms=args.timeout_ms,
        drain=args.drain,
        seed=args.seed,
        outputs=args.outputs,
        pixels=args.pixels,
        repeat_fraction=args.repeat_fraction,
        traced_connections=args.traced_connections,
    )
    photos = folder_photos(args.photos) if args.photos else builtin_photos()

    def announce(start: float, end: float) -> None:
        print(f"window {start:.6f} {end:.6f}", flush=True)

    report = run(spec, photos, announce if args.announce_window else None)
    print(summary(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    else:
        print(json.dumps(report, indent=1))
    sys.exit(0 if report["exactly_once"] else 1)


if __name__ == "__main__":
    main()
