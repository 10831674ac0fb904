"""Where built TensorRT engines live, and the key that keeps one GPU's engine off another.

An engine is only valid for the exact ONNX file, TensorRT version, GPU model and compute
capability, precision and optimization profile it was built with; the key names all of them,
so a mismatch is a cache miss (a rebuild), never a wrong engine. Nothing here imports
tensorrt: it is tested on the CPU.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

ENGINE_DIR = "engines"


@dataclass(frozen=True)
class EngineKey:
    onnx_sha256: str
    tensorrt_version: str
    gpu_name: str  # e.g. "NVIDIA H200"
    compute_capability: tuple[int, int]
    precision: str  # fp16 | fp32 | int8 | bf16
    profile: tuple[int, int, int]  # min / opt / max batch
    calibration_sha256: str = ""  # int8: hash of the calibration image list

    def filename(self) -> str:
        gpu = re.sub(r"[^A-Za-z0-9]+", "-", self.gpu_name).strip("-").lower()
        major, minor = self.compute_capability
        lo, opt, hi = self.profile
        extra = f"-cal{self.calibration_sha256[:8]}" if self.calibration_sha256 else ""
        return (
            f"{self.onnx_sha256[:16]}-trt{self.tensorrt_version}-{gpu}-sm{major}{minor}-"
            f"{self.precision}-b{lo}_{opt}_{hi}{extra}.engine"
        )

    def path(self, model_dir: Path) -> Path:
        return Path(model_dir) / ENGINE_DIR / self.filename()

    def timing_cache_path(self, model_dir: Path) -> Path:
        """One timing cache per TensorRT version and GPU: layer timings, reusable across builds."""
        gpu = re.sub(r"[^A-Za-z0-9]+", "-", self.gpu_name).strip("-").lower()
        return Path(model_dir) / ENGINE_DIR / f"timing-trt{self.tensorrt_version}-{gpu}.cache"


def optimization_profile(buckets: tuple[int, ...], opt: int | None = None) -> tuple[int, int, int]:
    """(min, opt, max) batch for one profile covering every bucket.

    TensorRT tunes kernels for `opt`; the default is the largest bucket not above 64, where a
    serving GPU spends most of its batches under load, while `max` still admits the largest.
    """
    ordered = sorted(buckets)
    if opt is None:
        opt = max((b for b in ordered if b <= 64), default=ordered[0])
    if not ordered[0] <= opt <= ordered[-1]:
        raise ValueError(f"opt batch {opt} is outside the buckets {ordered[0]}..{ordered[-1]}")
    return ordered[0], opt, ordered[-1]


def files_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
