"""TensorRT engine: ONNX -> serialized engine (FP16, or INT8 with entropy calibration), cached
per model hash + TensorRT version + GPU, run with `execute_async_v3` and captured as one CUDA
graph per batch bucket.

NEVER EXECUTED: TensorRT cannot be installed on any machine this project has (see README).
This module is written against the TensorRT 10 Python API documentation; everything here
that does not need TensorRT (buckets and plans, cache keys, the optimization profile,
calibration batches) lives in engines/buckets.py, engine_cache.py and calibration.py, where it
is tested and shared with the torch-CUDA engine.

CUDA memory and streams come from torch (not pycuda, which would create a second CUDA context
beside torch's): device buffers are torch tensors whose `data_ptr()` TensorRT reads and
writes, on a torch stream whose `cuda_stream` handle goes to `execute_async_v3`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engines.base import EngineError, EngineInfo
from engines.buckets import buckets_up_to
from engines.calibration import calibration_batches, calibration_images
from engines.cuda_graphs import CapturedGraph, GraphEngine, Slot, sample_input
from engines.engine_cache import EngineKey, files_digest, optimization_profile
from engines.repository import OUTPUT_NAMES, ModelRef

logger = logging.getLogger(__name__)

INPUT = "input"  # tensor names written by `raystream export`; outputs: OUTPUT_NAMES


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise EngineError(
            "engine 'tensorrt' needs the tensorrt Python package (TensorRT 10), "
            "which is not installed; install it from NVIDIA's index or set "
            "engine: torch-cuda"
        ) from exc
    return trt


def engine_key(
    model: ModelRef, precision: str, buckets: tuple[int, ...], calibration: list[Path] | None = None
) -> EngineKey:
    trt = _import_tensorrt()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return EngineKey(
        onnx_sha256=model.spec.onnx_sha256,
        tensorrt_version=trt.__version__,
        gpu_name=props.name,
        compute_capability=(props.major, props.minor),
        precision=precision,
        profile=optimization_profile(buckets),
        calibration_sha256=files_digest(calibration) if calibration else "",
    )


def build_engine(
    model: ModelRef,
    key: EngineKey,
    *,
    calibration: list[Path] | None = None,
    workspace_bytes: int = 8 << 30,
) -> Path:
    """Build the engine for `key` from model.onnx, save it (and the timing cache), return its
    path. INT8 needs `calibration` images."""
    trt = _import_tensorrt()
    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network = builder.create_network(0)  # TensorRT 10: networks are always explicit-batch
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse(model.onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT cannot parse {model.onnx_path}: {errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    size = model.spec.preprocess.input_size
    lo, opt, hi = key.profile
    profile = builder.create_optimization_profile()
    profile.set_shape(INPUT, (lo, 3, size, size), (opt, 3, size, size), (hi, 3, size, size))
    config.add_optimization_profile(profile)
    if key.precision in ("fp16", "int8"):
        config.set_flag(trt.BuilderFlag.FP16)  # INT8 engines fall back to FP16, not FP32
    if key.precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    if key.precision == "int8":
        if not calibration:
            raise EngineError(
                "precision int8 needs calibration images: pass "
                "--calibration-dir (a folder of representative photos)"
            )
        config.set_flag(trt.BuilderFlag.INT8)
        config.int8_calibrator = _entropy_calibrator(
            trt, model, calibration, opt, key.path(model.path).with_suffix(".calib")
        )
        config.set_calibration_profile(profile)

    timing_path = key.timing_cache_path(model.path)
    timing = config.create_timing_cache(timing_path.read_bytes() if timing_path.is_file() else b"")
    config.set_timing_cache(timing, ignore_mismatch=False)

    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError(
            f"TensorRT failed to build an engine for {key.filename()}; see the TensorRT log above"
        )
    path = key.path(model.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(path)  # atomic: a half-written engine is never loaded
    timing_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    logger.info("built %s in %.0f s", path, time.perf_counter() - start)
    return path


def _entropy_calibrator(
    trt, model: ModelRef, images: list[Path], batch_size: int, cache_path: Path
):
    """An IInt8EntropyCalibrator2 fed from `images` through the model's own preprocessing."""

    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._batches = calibration_batches(images, model.spec.preprocess, batch_size)
            size = model.spec.preprocess.input_size
            self._device = torch.empty(
                (batch_size, 3, size, size), dtype=torch.float32, device="cuda"
            )

        def get_batch_size(self) -> int:
            return batch_size

        def get_batch(self, names: list[str]) -> list[int] | None:
            batch = next(self._batches, None)
            if batch is None:
                return None
            self._device.copy_(torch.from_numpy(batch))
            torch.cuda.current_stream().synchronize()
            return [int(self._device.data_ptr())]

        def read_calibration_cache(self) -> bytes | None:
            return cache_path.read_bytes() if cache_path.is_file() else None

        def write_calibration_cache(self, cache: bytes) -> None:
            cache_path.write_bytes(bytes(cache))

    return EntropyCalibrator()


class TensorRTEngine(GraphEngine):
    def __init__(
        self,
        model: ModelRef,
        *,
        max_batch_size: int = 64,
        precision: str = "fp16",
        slots: int = 2,
        calibration_dir: str | None = None,
        build: bool = True,
    ) -> None:
        trt = _import_tensorrt()
        if not torch.cuda.is_available():
            raise EngineError("engine 'tensorrt' needs a CUDA GPU and none is visible")
        if precision not in ("fp32", "fp16", "bf16", "int8"):
            raise EngineError(
                f"tensorrt precision must be fp32, fp16, bf16 or int8, got {precision!r}"
            )
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.buckets = buckets_up_to(max_batch_size)
        calibration = calibration_images(Path(calibration_dir)) if calibration_dir else None
        key = engine_key(model, precision, self.buckets, calibration)
        path = key.path(model.path)
        if not path.is_file():
            if not build:
                raise EngineError(
                    f"no TensorRT engine {path.name} for this GPU and TensorRT "
                    f"{trt.__version__}: run `raystream build-engine`"
                )
            build_engine(model, key, calibration=calibration)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self._engine is None:
            raise EngineError(
                f"TensorRT could not load {path} (built for another TensorRT or "
                f"GPU?); delete it and run `raystream build-engine`"
            )
        size = model.spec.preprocess.input_size
        self.info = EngineInfo(
            engine="tensorrt",
            input_shape=(3, size, size),
            num_classes=model.spec.num_classes,
            max_batch_size=max_batch_size,
            precision=precision,
            device=str(self.device),
            embedding_dim=model.spec.embedding_dim,
        )
        self._contexts: dict[int, object] = {}  # one execution context per slot
        self._start_slots(slots, plan_by_latency=True)

    def _capture(self, bucket: int, slot: Slot) -> CapturedGraph:
        # Each slot owns one execution context; its graphs bake in that context's buffers.
        ctx = self._contexts.get(id(slot))
        if ctx is None:
            ctx = self._contexts[id(slot)] = self._engine.create_execution_context()
        c, h, w = self.info.input_shape
        static_in = sample_input((bucket, c, h, w), self.device)
        # float32 outputs, as the ONNX model declares them (logits, then the embedding)
        outputs = tuple(
            torch.empty((bucket, width), device=self.device) for width in self.output_widths()
        )
        ctx.set_input_shape(INPUT, (bucket, c, h, w))
        ctx.set_tensor_address(INPUT, static_in.data_ptr())
        for name, output in zip(OUTPUT_NAMES, outputs, strict=False):
            ctx.set_tensor_address(name, output.data_ptr())
        # One run outside capture lets TensorRT allocate and finish shape-dependent setup.
        if not ctx.execute_async_v3(slot.stream.cuda_stream):
            raise EngineError(f"TensorRT execute_async_v3 failed at batch {bucket}")
        slot.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=slot.stream):
            ctx.execute_async_v3(slot.stream.cuda_stream)
        return CapturedGraph(graph, static_in, outputs)

    def close(self) -> None:
        super().close()
        self._contexts.clear()
        self._engine = None
