"""Where a GPU Inference replica's start-up goes, phase by phase, each in a fresh process.

    python bench/gpu_startup.py [--model efficientnet-lite0] [--out DIR]

Runs the torch-CUDA engine from the torch.export program in a fresh process per mode (import
torch, load the program, move it to the GPU, capture each bucket's graph, time the replays,
warm the nvJPEG decoder): `default` (ready once the largest bucket is captured, the others
in the background), `all-at-start` (every bucket before ready) and `autotune` (that, with
cuDNN's algorithm search on), each mode's outputs against the default's. Prints a table
last and writes startup.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


MODES = {  # engine options of each mode
    "default": {},
    "all-at-start": {"background_capture": False},
    "autotune": {"background_capture": False, "autotune": True},
}


def _child(mode: str, args: argparse.Namespace) -> dict:
    """One fresh process: its phases as JSON on its last line of output."""
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--model",
            args.model,
            "--repository",
            args.repository,
            "--out",
            str(args.out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stdout[-1000:] + " | " + done.stderr[-1500:]).replace("\n", " / ")
        return {"mode": mode, "failed": f"rc {done.returncode}: {tail}", "wall_s": wall}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(mode=mode, wall_s=wall)
    return result


def child(mode: str, args: argparse.Namespace) -> dict:
    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = round(now - clock, 3)
        clock = now
        print(f"{mode}: {name} {phases[name]}", file=sys.stderr, flush=True)

    sys.path[:0] = [str(ROOT), str(ROOT / "protos")]
    import torch

    lap("import_torch")
    import numpy as np

    from engines.repository import resolve
    from engines.torch_cuda import TorchCudaEngine

    model = resolve(Path(args.repository), args.model)
    lap("import_engines")
    torch.zeros(1, device="cuda")
    lap("cuda_init")
    options = {
        "input_shape": (3, 224, 224),
        "num_classes": model.spec.num_classes,
        "embedding_dim": model.spec.embedding_dim,
        "max_batch_size": 64,
    }
    captures: dict[int, float] = {}  # per bucket: its first pass and its capture in each slot
    add_bucket, warm_up = TorchCudaEngine._add_bucket, TorchCudaEngine._warm_up

    def timed(method):
        def run(self, bucket):
            begin = time.perf_counter()
            method(self, bucket)
            spent = time.perf_counter() - begin
            captures[bucket] = round(captures.get(bucket, 0.0) + spent, 3)

        return run

    TorchCudaEngine._add_bucket, TorchCudaEngine._warm_up = timed(add_bucket), timed(warm_up)
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((16, 3, 224, 224)).astype(np.float32)
    program = torch.export.load(str(model.torch_path))
    lap("export_load")
    module = program.module()
    lap("unlift_module")
    engine = TorchCudaEngine(module, **MODES[mode], **options)
    lap("engine_ready")
    engine.captured.wait()
    lap("other_buckets")
    phases.update({f"capture.b{k}": v for k, v in sorted(captures.items())})
    replay = engine.measure_replays()
    out = engine.infer(batch)
    np.savez(args.out / f"outputs-{mode}.npz", logits=out.logits, embedding=out.embedding)
    from engines.gpu_decode import GpuJpegDecoder
    from engines.images import DecodeLimits

    lap("measure")
    GpuJpegDecoder(model.spec.preprocess, DecodeLimits()).warmup()
    lap("decoder_warmup")
    return {"phases": phases, "replay_ms": replay}


def _compare(mode: str, out: Path) -> dict:
    """`mode`'s outputs against the default mode's, on the same batch."""
    import numpy as np

    try:
        base, mine = np.load(out / "outputs-default.npz"), np.load(out / f"outputs-{mode}.npz")
    except OSError:
        return {}
    cosine = float(np.min(np.sum(base["embedding"] * mine["embedding"], axis=1)))
    diff = float(np.abs(base["logits"] - mine["logits"]).max())
    return {"max_logit_diff": diff, "min_emb_cosine": cosine}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--repository", default=str(ROOT / "models"))
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--child")
    parser.add_argument("--modes", default="default,all-at-start")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in args.modes.split(","):
        row = _child(mode, args)
        if mode != "default":
            row.update(_compare(mode, args.out))
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "startup.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'mode':<20} {'wall s':>7}  phases")
    for row in rows:
        phases = " ".join(f"{k}={v}" for k, v in row.get("phases", {}).items())
        print(f"{row['mode']:<20} {row['wall_s']:7.1f}  {phases or row.get('failed', '')[-300:]}")
        if "replay_ms" in row:
            print(f"{'':<29}replay ms {row['replay_ms']}  {_fmt(row)}")
    return 0


def _fmt(row: dict) -> str:
    keys = ("max_logit_diff", "min_emb_cosine")
    return " ".join(f"{k}={row[k]:.4g}" for k in keys if k in row)


if __name__ == "__main__":
    sys.exit(main())
