"""torch-CUDA engine: FP16/BF16 (or FP32), channels-last, one CUDA graph per batch bucket.

Start-up: load the module (the torch.export program written by `raystream export`), warm it
up, optionally `torch.compile` it (default mode, no autotuning, so start-up stays bounded)
for buckets from `compile_min_batch` up, capture one CUDA graph per bucket and slot
(engines/cuda_graphs.py), and time each replay for the bucket planner. The engine is ready
once the largest bucket is captured; by default the others follow in the background, each
warmed on a stream of its own first, so no request waits for a capture.

With `compile_after_ready`, the engine is ready before anything is compiled: every bucket is
first captured from the uncompiled module, then compiled in the background, largest first,
each compiled graph replacing its uncompiled one as it is done. On a host whose inductor
cache is empty, the first compile (tens of seconds) no longer delays ready; until the swaps
are done, batches run at the uncompiled module's speed.
"""

from __future__ import annotations

import logging
import time

import torch

from engines.base import EngineError, EngineInfo
from engines.buckets import buckets_up_to
from engines.compile_once import compile_key, compile_once
from engines.cuda_graphs import (
    CapturedGraph,
    GraphEngine,
    Slot,
    sample_input,
    sleep_in_every_gpu_wait,
    wait_asleep,
)
from engines.repository import ModelRef

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Processes of a host that compile from inductor's cache at a time while serving
# (compile_after_ready): each trace takes a core for seconds, which serving then lacks.
COMPILES_AT_ONCE = 4
# Inductor's kernel-compiling workers in a process that compiles while serving: by default
# one per core of the host, all busy for the seconds of a first compile while the host's
# other replicas serve.
COMPILE_THREADS_WHILE_SERVING = 4


class TorchCudaEngine(GraphEngine):
    """`module` must already be in inference mode: `.eval()` for an nn.Module; a torch.export
    program's module is (and refuses `.eval()`)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        input_shape: tuple[int, int, int],
        num_classes: int,
        embedding_dim: int = 0,
        max_batch_size: int = 64,
        precision: str = "fp16",
        device: str = "cuda",
        slots: int = 2,
        compile_min_batch: int | None = None,
        plan_by_latency: bool = True,
        blocking_sync: bool = False,
        autotune: bool = False,
        background_capture: bool = True,
        compile_after_ready: bool = False,
        compile_name: str | None = None,
    ) -> None:
        """`module` returns the logits, or (logits, embedding) where `embedding_dim` > 0.
        autotune: cuDNN times every convolution algorithm for each bucket's shapes at
        start-up. Off by default: on an H200 it added 16 s to EfficientNet-Lite0's start and
        left every bucket's replay time unchanged (bench/gpu_startup.py).
        blocking_sync: every wait for the GPU in this process sleeps instead of spinning
        a core (cuda_graphs.sleep_in_every_gpu_wait), the nvJPEG decoder's included.
        background_capture: ready once the largest bucket is captured; the smaller ones
        follow while the engine serves. The first pass at each batch size is what takes
        time (cuDNN picks and builds every convolution's kernels for the new shapes: about
        2.5 s a bucket for EfficientNet-Lite0 on an H200), so this cuts the start by that
        much per bucket. Until a bucket joins, batches of its size run padded into a larger
        one. `captured` is set once all are in.
        compile_after_ready (with compile_min_batch and background_capture): ready on
        graphs of the uncompiled module; the compiled ones replace them in the background,
        at most COMPILES_AT_ONCE processes of the host compiling from inductor's cache at
        a time. `captured` is set once all compiled graphs are in.
        compile_name: names the compiled program (`from_model`: its file); with it, one
        process of the host compiles each bucket and the others read inductor's cache
        (engines/compile_once.py)."""
        if precision not in DTYPES:
            raise EngineError(
                f"torch-cuda runs fp32, fp16 or bf16, got precision "
                f"{precision!r} (int8 needs engine: tensorrt)"
            )
        if not torch.cuda.is_available():
            raise EngineError("torch-cuda needs a CUDA GPU and none is visible")
        start = time.perf_counter()
        self.device = torch.device(device)
        if blocking_sync:
            sleep_in_every_gpu_wait(self.device)
        self.dtype = DTYPES[precision]
        self.buckets = buckets_up_to(max_batch_size)
        self.info = EngineInfo(
            engine="torch-cuda",
            input_shape=tuple(input_shape),
            num_classes=num_classes,
            max_batch_size=max_batch_size,
            precision=precision,
            device=str(self.device),
            embedding_dim=embedding_dim,
        )
        torch.backends.cudnn.benchmark = autotune
        self._module = module.to(self.device, self.dtype).to(memory_format=torch.channels_last)
        self._compiled = (
            torch.compile(self._module, dynamic=False) if compile_min_batch is not None else None
        )
        compiled = (
            [b for b in self.buckets if b >= (compile_min_batch or 0)]
            if self._compiled is not None
            else []
        )
        after_ready = compile_after_ready and background_capture
        # the buckets whose graphs run the compiled module (those to compile, once they are)
        self._runs_compiled = set() if after_ready else set(compiled)
        self._compile_at_once = COMPILES_AT_ONCE if after_ready else 0
        if after_ready and compiled:
            import torch._inductor.config as inductor

            inductor.compile_threads = min(inductor.compile_threads, COMPILE_THREADS_WHILE_SERVING)
        self._compile_name = compile_name
        self._compiled_buckets: set[int] = set()  # compiled in this process
        self._warm_stream = torch.cuda.Stream(self.device)
        self._start_slots(
            slots,
            plan_by_latency,
            background=background_capture,
            recapture=tuple(sorted(compiled, reverse=True)) if after_ready else (),
        )
        self.startup_s = time.perf_counter() - start
        logger.info(
            "torch-cuda ready in %.1f s: %s, %d slots, buckets %s captured%s, replay ms %s%s",
            self.startup_s,
            precision,
            slots,
            self.planner.buckets,
            "" if self.captured.is_set() else f" (the rest of {self.buckets} in the background)",
            self.replay_ms,
            f"; {sorted(compiled)} compiled after ready" if after_ready else "",
        )

    @classmethod
    def from_model(cls, model: ModelRef, **options: object) -> TorchCudaEngine:
        if not model.torch_path.is_file():
            raise EngineError(
                f"{model.torch_path} is missing: run `raystream export` (it writes "
                f"the torch.export program next to model.onnx)"
            )
        if changed := model.changed_since_export(model.torch_path):
            raise EngineError(changed)
        try:
            module = torch.export.load(str(model.torch_path)).module()
        except Exception as exc:
            raise EngineError(
                f"cannot load {model.torch_path} with torch {torch.__version__}: "
                f"{exc}; re-run `raystream export` with this torch"
            ) from exc
        size = model.spec.preprocess.input_size
        program = model.torch_path.stat()
        compile_name = f"{model.torch_path.resolve()}:{program.st_size}:{program.st_mtime_ns}"
        return cls(
            module,
            input_shape=(3, size, size),
            num_classes=model.spec.num_classes,
            embedding_dim=model.spec.embedding_dim,
            compile_name=compile_name,
            **options,
        )

    def _function(self, bucket: int) -> torch.nn.Module:
        return self._compiled if bucket in self._runs_compiled else self._module

    def _before_recapture(self, bucket: int) -> None:
        self._runs_compiled.add(bucket)  # its next capture: the compiled module's graph

    def _random_input(self, bucket: int) -> torch.Tensor:
        c, h, w = self.info.input_shape
        return (
            sample_input((bucket, c, h, w), self.device)
            .to(self.dtype)
            .contiguous(memory_format=torch.channels_last)
        )

    def _first_pass(self, bucket: int, batch: torch.Tensor) -> object:
        """The bucket's function on `batch`. A compiled bucket's first pass in this process
        compiles it: where the host's other replicas compile the same, only one at a time
        does the work (compile_once)."""
        fn = self._function(bucket)
        if fn is self._module or self._compile_name is None or bucket in self._compiled_buckets:
            return fn(batch)
        key = compile_key(
            self._compile_name,
            torch.__version__,
            torch.cuda.get_device_name(self.device),
            self.info.precision,
            bucket,
        )
        out = compile_once(key, lambda: fn(batch), at_once=self._compile_at_once)
        self._compiled_buckets.add(bucket)
        return out

    def _warm_up(self, bucket: int) -> None:
        with torch.inference_mode(), torch.cuda.stream(self._warm_stream):
            self._first_pass(bucket, self._random_input(bucket))
        wait_asleep(self._warm_stream)

    def _capture(self, bucket: int, slot: Slot) -> CapturedGraph:
        fn = self._function(bucket)
        slot.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(slot.stream):
            static_in = self._random_input(bucket)
            for _ in range(3):  # autotuning, compilation and lazy init happen here
                self._first_pass(bucket, static_in)
        slot.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the process's other threads (nvJPEG's decode, the engine's serving
        # threads during a background capture) may allocate meanwhile; only this one must not.
        with torch.cuda.graph(
            graph, pool=slot.pool, stream=slot.stream, capture_error_mode="thread_local"
        ):
            static_out = fn(static_in)  # both outputs of the one pass: both captured
        outputs = tuple(static_out) if isinstance(static_out, tuple | list) else (static_out,)
        self._check_outputs(outputs, bucket)
        return CapturedGraph(graph, static_in, outputs)

    def close(self) -> None:
        super().close()
        self._module = self._compiled = None
