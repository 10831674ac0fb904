"""Engine benchmark on a GPU: PyTorch eager FP32 (the baseline users start from) against the
torch-CUDA engine, per technique, on ResNet50 (torchvision, random weights) and the default
model, at batch 1, 8, 64 and 256. Median of CUDA-event-timed calls after warm-up, all in one
run, ratios against the eager FP32 baseline of that same run.

    python bench/engine_bench.py --repository models --json out.json

Rows per model and batch:
  eager-fp32        model(x), x already on the GPU (the baseline)
  eager-fp16-cl     FP16 weights and activations, channels-last
  graph-fp16        + one CUDA graph per bucket (the engine without torch.compile)
  graph-fp16-compile+ torch.compile (default mode) before capture, buckets >= 64
  graph-bf16        BF16 instead of FP16, graph-captured
  engine-e2e-fp16   engine.infer_uint8 from host uint8 crops: upload, normalize, replay,
                    download (what a served batch costs), graph-fp16-compile engine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.repository import resolve
from engines.torch_cuda import TorchCudaEngine

BATCHES = (1, 8, 64, 256)


def cuda_time_ms(fn, repeats: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return float(np.median(times))


def eager_ms(
    module: torch.nn.Module, batch: int, dtype: torch.dtype, channels_last: bool, repeats: int
) -> float:
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        return cuda_time_ms(lambda: module(x), repeats)


def load_models(repository: Path) -> dict[str, callable]:
    from torchvision.models import resnet50

    def resnet() -> torch.nn.Module:
        torch.manual_seed(0)
        return resnet50().eval()

    def default() -> torch.nn.Module:
        return torch.export.load(str(resolve(repository, "efficientnet-lite0").torch_path)).module()

    return {"resnet50": resnet, "efficientnet-lite0": default}


def bench_model(name: str, build, repeats: int) -> list[dict]:
    rows = []
    fp32 = build().cuda()
    fp16 = build().cuda().half().to(memory_format=torch.channels_last)
    for b in BATCHES:
        rows.append(
            {
                "model": name,
                "batch": b,
                "variant": "eager-fp32",
                "ms": eager_ms(fp32, b, torch.float32, False, repeats),
            }
        )
        rows.append(
            {
                "model": name,
                "batch": b,
                "variant": "eager-fp16-cl",
                "ms": eager_ms(fp16, b, torch.float16, True, repeats),
            }
        )
    del fp32, fp16
    torch.cuda.empty_cache()
    variants = {
        "graph-fp16": {"precision": "fp16"},
        "graph-fp16-compile": {"precision": "fp16", "compile_min_batch": 64},
        "graph-bf16": {"precision": "bf16"},
    }
    for variant, options in variants.items():
        start = time.perf_counter()
        engine = TorchCudaEngine(
            build(),
            input_shape=(3, 224, 224),
            num_classes=1000,
            max_batch_size=max(BATCHES),
            slots=1,
            background_capture=False,
            **options,
        )
        startup = time.perf_counter() - start
        replay = engine.measure_replays(repeats)
        for b in BATCHES:
            rows.append(
                {
                    "model": name,
                    "batch": b,
                    "variant": variant,
                    "ms": replay[b],
                    "startup_s": round(startup, 1),
                }
            )
        if variant == "graph-fp16-compile":
            rows += end_to_end_rows(name, engine, repeats)
        engine.close()
    return rows


def end_to_end_rows(name: str, engine: TorchCudaEngine, repeats: int) -> list[dict]:
    """What a served batch costs: uint8 crops from host memory to logits in host memory."""
    rng = np.random.default_rng(0)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    rows = []
    for b in BATCHES:
        crops = rng.integers(0, 256, (b, 224, 224, 3), dtype=np.uint8)
        ms = host_time_ms(lambda c=crops: engine.infer_uint8(c, mean, std), repeats)
        rows.append({"model": name, "batch": b, "variant": "engine-e2e-fp16", "ms": ms})
    return rows


def host_time_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--models", nargs="+", default=["resnet50", "efficientnet-lite0"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    builders = load_models(args.repository)
    rows = []
    for name in args.models:
        rows += bench_model(name, builders[name], args.repeats)
    base = {(r["model"], r["batch"]): r["ms"] for r in rows if r["variant"] == "eager-fp32"}
    for r in rows:
        r["images_per_s"] = round(r["batch"] / r["ms"] * 1000.0, 1)
        r["x_eager_fp32"] = round(base[(r["model"], r["batch"])] / r["ms"], 2)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                indent=1,
            )
        )
    print(
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"median of {args.repeats} CUDA-event-timed calls"
    )
    print(f"{'model':<19}{'variant':<20}{'batch':>6}{'ms':>9}{'img/s':>10}{'x eager32':>10}")
    for r in rows:
        print(
            f"{r['model']:<19}{r['variant']:<20}{r['batch']:>6}{r['ms']:>9.3f}"
            f"{r['images_per_s']:>10.0f}{r['x_eager_fp32']:>10.2f}"
        )


if __name__ == "__main__":
    main()
