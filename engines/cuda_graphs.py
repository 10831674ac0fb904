"""The serving half shared by both graph-captured GPU engines (torch-CUDA and TensorRT).

A `GraphEngine` holds `slots` independent sets of {CUDA stream, pinned host buffers, device
staging buffer, graph memory pool, one captured graph per bucket}. A batch takes a free slot
for its whole run, so with `@serve.batch(max_concurrent_batches=k)` and k <= slots no two
batches ever write the same static input or intermediate buffer, while one batch's host
copies overlap another's GPU work. A batch of n images runs as the pieces `BucketPlanner`
chooses among the buckets captured so far, each copied from pinned memory into its graph's
static input on the slot's stream (normalized there when it arrives as uint8), replayed, and
its outputs (logits and, where the model has one, the embedding: every output of the one
pass) copied back.

Start-up captures the largest bucket in every slot; the others follow, at start or (with
`background`) in a thread while the engine already serves: a replica takes traffic seconds
sooner, and until a smaller bucket joins the planner, batches run padded into larger ones.
Buckets may then be captured again, each new graph replacing the old (torch-CUDA's compiled
graphs after the uncompiled ones: engines/torch_cuda.py, `compile_after_ready`).
"""

from __future__ import annotations

import abc
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from engines.base import Engine, EngineError, Outputs
from engines.buckets import BucketPlanner

logger = logging.getLogger(__name__)

CU_CTX_SCHED_BLOCKING_SYNC = 0x04  # cuda.h
# One engine of the process warms up, captures or frees cached memory at a time.
# torch.cuda.graph synchronizes the whole device as a capture starts (and freeing cached
# memory can too): done while another engine of the process captures (two model versions
# loading at once, or one loading while another still captures its smaller buckets in the
# background), it fails (cudaErrorStreamCaptureUnsupported) and invalidates that capture.
CAPTURING = threading.Lock()


def sleep_in_every_gpu_wait(device: torch.device) -> None:
    """Make every wait for `device` in this process sleep, also those inside libraries
    (torchvision's nvJPEG decode, cuDNN, copies to the host) that wait_asleep cannot reach:
    the blocking-sync flag on the device's primary context, set through the driver API
    (torch does not expose it). Call before the process first uses the device."""
    driver = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_int()
    _driver_call("cuInit", driver.cuInit(0))
    _driver_call("cuDeviceGet", driver.cuDeviceGet(ctypes.byref(handle), device.index or 0))
    status = driver.cuDevicePrimaryCtxSetFlags_v2(handle, CU_CTX_SCHED_BLOCKING_SYNC)
    _driver_call("cuDevicePrimaryCtxSetFlags", status)


def _driver_call(name: str, status: int) -> None:
    if status != 0:
        raise EngineError(f"{name} failed with CUDA driver error {status}")


def wait_asleep(stream: torch.cuda.Stream) -> None:
    """Block until the work queued on `stream` is done, the thread asleep. Its own
    `synchronize()` spins a core all the while (CUDA spins when a process has fewer contexts
    than the machine has cores): sixteen replicas' decode and engine threads waiting on one
    shared GPU that way burn cores that the rest of the server needs."""
    done = torch.cuda.Event(blocking=True)  # cudaEventBlockingSync
    done.record(stream)
    done.synchronize()


def sample_input(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Random float32 input for warm-up passes and graph capture, from a generator of its
    own. While any thread captures a graph, torch marks the default CUDA generator as
    capturing, and an RNG call on it from another thread fails ("Offset increment outside
    graph capture"): another engine's capture thread in the same process (a second model
    version loading while the first captures its smaller buckets) would."""
    return torch.randn(shape, device=device, generator=torch.Generator(device=device))


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    input: torch.Tensor  # (bucket, C, H, W): the graph's static input
    # The graph's static outputs, in the model's order (`GraphEngine.output_widths`):
    # logits (bucket, classes), then the embedding (bucket, D) if the model has one.
    outputs: tuple[torch.Tensor, ...]


class Slot:
    def __init__(self, engine: GraphEngine) -> None:
        c, h, w = engine.info.input_shape
        n, device = engine.info.max_batch_size, engine.device
        self.stream = torch.cuda.Stream(device)
        # The slot's graphs share one memory pool (they never run at once: a slot runs one
        # batch at a time, its pieces in order); two slots' graphs do run at once, so each
        # slot has its own, or their intermediate buffers would overlap.
        self.pool = torch.cuda.graph_pool_handle()
        self.host_u8 = torch.empty((n, h, w, c), dtype=torch.uint8).pin_memory()
        self.host_f32 = torch.empty((n, c, h, w), dtype=torch.float32).pin_memory()
        self.host_out = tuple(
            torch.empty((n, width), dtype=torch.float32).pin_memory()
            for width in engine.output_widths()
        )
        self.device_u8 = torch.empty((n, h, w, c), dtype=torch.uint8, device=device)
        self.graphs: dict[int, CapturedGraph] = {}


Fill = Callable[[CapturedGraph, int, int, int], None]


class GraphEngine(Engine):
    """Subclasses set `info`, `device`, `buckets`, implement `_capture`, then call
    `_start_slots()`."""

    device: torch.device
    buckets: tuple[int, ...]
    planner: BucketPlanner

    @abc.abstractmethod
    def _capture(self, bucket: int, slot: Slot) -> CapturedGraph:
        """Warm up and capture the graph for `bucket` on `slot.stream`, in `slot.pool`."""

    def _warm_up(self, bucket: int) -> None:
        """The slow first pass at a new batch size, holding no slot (so serving goes on)."""

    def output_widths(self) -> tuple[int, ...]:
        """The width of each static output: the classes, then the embedding's (if any)."""
        info = self.info
        return (info.num_classes, info.embedding_dim) if info.embedding_dim else (info.num_classes,)

    def _check_outputs(self, outputs: tuple[torch.Tensor, ...], bucket: int) -> None:
        shapes = [tuple(out.shape) for out in outputs]
        expected = [(bucket, width) for width in self.output_widths()]
        if shapes != expected:
            raise EngineError(
                f"the model's outputs have shapes {shapes}, expected {expected} (logits, "
                f"then the embedding if model.json gives embedding_dim); re-run "
                f"`raystream export`"
            )

    def _start_slots(
        self,
        slots: int,
        plan_by_latency: bool,
        background: bool = False,
        recapture: tuple[int, ...] = (),
    ) -> None:
        """Capture the largest bucket in every slot, then the others: here, or with
        `background` in a thread (`captured` is set when every bucket is in). `recapture`
        (with `background`): buckets captured once more after that, each replacing its
        graph as it is done (torch-CUDA's compiled graphs, in place of the uncompiled).
        `captured` is also set when the thread gives up on a failure (logged), with the
        graphs captured so far serving."""
        self._normalize: tuple[torch.Tensor, torch.Tensor] | None = None  # uint8 scale, shift
        self._plan_by_latency = plan_by_latency
        self.replay_ms: dict[int, float] = {}  # each captured bucket's median replay
        self.captured = threading.Event()
        self._closing = False
        self._slots: queue.Queue[Slot] = queue.Queue()
        # Taken to take a slot. A capture takes every slot under it, so batches that keep
        # coming cannot starve it of the last one (queue.Queue is not fair to waiters).
        self._taking = threading.Lock()
        for _ in range(slots):
            self._slots.put(Slot(self))
        self._slot_count = slots
        largest, *others = sorted(self.buckets, reverse=True)  # largest first: pool reuse
        self._add_bucket(largest)
        self._capturing = None
        if background and (others or recapture):
            # Not a daemon: at exit Python kills daemon threads where they are, and one
            # killed inside a capture aborts the process ("terminate called without an
            # active exception"), e.g. a script that exits without closing its engine.
            self._capturing = threading.Thread(
                target=self._add_buckets_or_log, args=(others, recapture), name="capture"
            )
            self._capturing.start()
        else:
            self._add_buckets(others)

    def _add_buckets(self, buckets: list[int], recapture: tuple[int, ...] = ()) -> None:
        for again, todo in ((False, buckets), (True, recapture)):
            started = time.perf_counter()
            for bucket in todo:
                if self._closing:
                    return
                if again:
                    self._before_recapture(bucket)
                with CAPTURING:
                    self._warm_up(bucket)
                self._add_bucket(bucket)
            if todo:
                logger.info(
                    "buckets %s captured%s in %.1f s; replay ms %s",
                    list(todo),
                    " again" if again else "",
                    time.perf_counter() - started,
                    self.replay_ms,
                )
        self.captured.set()

    def _before_recapture(self, bucket: int) -> None:
        """What changes before `bucket` is captured again (`_start_slots`' recapture)."""

    def _add_buckets_or_log(self, buckets: list[int], recapture: tuple[int, ...]) -> None:
        try:
            self._add_buckets(buckets, recapture)
        except Exception:
            # The engine goes on with the graphs it has: every batch still has a plan.
            logger.exception("capturing buckets failed; serving with %s", self.planner.buckets)
        finally:
            self.captured.set()  # nothing more will come: whoever waits for it, wait no more

    def _add_bucket(self, bucket: int) -> None:
        """Capture `bucket` in every slot, holding them all (no batch runs meanwhile: a
        pause of tens of ms once its kernels are warm), time its replay, then plan with it.
        A bucket captured before gets the new graph in place of the old one.
        The slots are taken once no other engine captures (CAPTURING), so batches run
        while this one waits."""
        with CAPTURING:
            with self._taking:
                held = [self._slots.get() for _ in range(self._slot_count)]
            try:
                with torch.inference_mode():
                    for slot in held:
                        slot.graphs[bucket] = self._capture(bucket, slot)
                    if self._plan_by_latency:
                        self.replay_ms[bucket] = self._median_replay_ms(held[0], bucket)
            finally:
                for slot in held:
                    self._slots.put(slot)
        ready = sorted(held[0].graphs)
        self.planner = BucketPlanner(ready, self.replay_ms if self._plan_by_latency else None)

    @staticmethod
    def _median_replay_ms(slot: Slot, bucket: int, repeats: int = 20) -> float:
        graph = slot.graphs[bucket].graph
        times = []
        # replay() launches on the current stream: make it the slot's, as serving does.
        with torch.cuda.stream(slot.stream):
            for _ in range(repeats):
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
        return float(np.median(times))

    def measure_replays(self, repeats: int = 20) -> dict[int, float]:
        """Median replay time of each captured bucket's graph (CUDA events)."""
        with self._slot() as slot, torch.inference_mode():
            return {bucket: self._median_replay_ms(slot, bucket, repeats) for bucket in slot.graphs}

    @contextmanager
    def _slot(self) -> Iterator[Slot]:
        with self._taking:
            slot = self._slots.get()
        try:
            yield slot
        finally:
            self._slots.put(slot)

    def _run(self, slot: Slot, n: int, fill: Fill) -> Outputs:
        lo = 0
        planner = self.planner  # buckets may join meanwhile: one plan, from one planner
        # Input the caller made on its own stream (crops joined on the GPU) is ready first.
        slot.stream.wait_stream(torch.cuda.current_stream(self.device))
        timed = self.time_gpu
        with torch.inference_mode(), torch.cuda.stream(slot.stream):
            if timed:
                began = torch.cuda.Event(enable_timing=True)
                ended = torch.cuda.Event(enable_timing=True)
                began.record(slot.stream)
            for bucket in planner.plan(n):
                count = min(bucket, n - lo)
                graph = slot.graphs[bucket]
                fill(graph, lo, lo + count, count)
                graph.graph.replay()
                for host, output in zip(slot.host_out, graph.outputs, strict=True):
                    host[lo : lo + count].copy_(output[:count], non_blocking=True)
                lo += count
            if timed:
                ended.record(slot.stream)
            wait_asleep(slot.stream)
        # Both events are done once the stream is: reading them waits for nothing more.
        gpu_ms = began.elapsed_time(ended) if timed else 0.0
        results = [host[:n].numpy().copy() for host in slot.host_out]
        if len(results) == 1:
            return Outputs.logits_only(results[0], gpu_ms)
        # Normalized on the GPU in the engine's dtype, whose rounding (FP16, BF16) leaves
        # norms up to ~1e-3 from 1: exactly 1 again, in float32.
        logits, embedding = results
        embedding /= np.maximum(np.linalg.norm(embedding, axis=1, keepdims=True), 1e-12)
        return Outputs(logits, embedding, gpu_ms)

    def _infer(self, batch: np.ndarray) -> Outputs:
        n = len(batch)
        with self._slot() as slot:
            slot.host_f32[:n].numpy()[...] = batch

            def fill(graph: CapturedGraph, lo: int, hi: int, count: int) -> None:
                graph.input[:count].copy_(slot.host_f32[lo:hi].to(self.device, non_blocking=True))

            return self._run(slot, n, fill)

    def infer_uint8(
        self, images: np.ndarray | torch.Tensor, mean: np.ndarray, std: np.ndarray
    ) -> Outputs:
        """Upload uint8 crops (a quarter of float32's bytes) and normalize on the GPU. Crops
        already on this device (a tensor: engines/gpu_decode.py) are read where they are."""
        c, h, w = self.info.input_shape
        n = len(images)
        on_device = isinstance(images, torch.Tensor)
        if not 1 <= n <= self.info.max_batch_size or tuple(images.shape[1:]) != (h, w, c):
            if on_device:
                raise ValueError(f"crops must be (1..{self.info.max_batch_size}, {h}, {w}, {c})")
            return super().infer_uint8(images, mean, std)  # the base class's checks and errors
        if self._normalize is None:  # both at once: another serving thread may read them
            scale = torch.tensor(1.0 / (255.0 * std), device=self.device).view(1, -1, 1, 1)
            shift = torch.tensor(mean / std, device=self.device).view(1, -1, 1, 1)
            self._normalize = scale, shift
        scale, shift = self._normalize
        with self._slot() as slot:
            if not on_device:
                slot.host_u8[:n].numpy()[...] = images

            def fill(graph: CapturedGraph, lo: int, hi: int, count: int) -> None:
                if on_device:
                    pixels = images[lo:hi]
                else:
                    pixels = slot.device_u8[lo:hi]
                    pixels.copy_(slot.host_u8[lo:hi], non_blocking=True)
                graph.input[:count].copy_(
                    pixels.permute(0, 3, 1, 2).float().mul_(scale).sub_(shift)
                )

            return self._run(slot, n, fill)

    def close(self) -> None:
        self._closing = True
        if self._capturing is not None:
            self._capturing.join()  # at most one bucket's capture away
        while not self._slots.empty():
            self._slots.get_nowait()
        with CAPTURING:
            torch.cuda.empty_cache()
