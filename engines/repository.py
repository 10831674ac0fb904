"""The model repository: `<root>/<name>/<version>/` holding the artifacts and `model.json`.

    models/efficientnet-lite0/1/
        model.onnx      ONNX (opset 17, dynamic batch): ONNX Runtime and TensorRT read it
        model.pt2       torch.export program: the torch-CUDA engine reads it
        model.json      ModelSpec below: preprocessing, labels, outputs, hashes
        engines/        TensorRT engines built from model.onnx, one per GPU/TensorRT version

Versions are directory names; the highest integer version is the default.

Both model files have two outputs, `logits` (N, classes) and `embedding` (N, D), the
L2-normalized pooled features (`export_format` 2). A version written before embeddings
existed (no `export_format` in its model.json: format 1) has `logits` only: it loads and
serves labels, with `embedding_dim` 0.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

SPEC_FILE = "model.json"
# What `raystream export` writes now: 1 = logits only; 2 = logits and embedding.
EXPORT_FORMAT = 2
OUTPUT_NAMES = ("logits", "embedding")  # the model files' outputs, in this order
ONNX_FILE = "model.onnx"
TORCH_FILE = "model.pt2"


# How the server's answer to a load that failed on some replica begins (an UNAVAILABLE that
# the CLI tells apart from a server it cannot reach).
LOAD_FAILED = "loading failed"


class ModelNotFoundError(LookupError):
    """No such model or version in the repository; the message says what exists."""


@dataclass(frozen=True)
class PreprocessSpec:
    """How the model expects its input: resize the shorter side, center-crop, normalize."""

    input_size: int = 224  # square crop fed to the model
    resize_size: int = 256  # shorter side before the crop (EfficientNet's crop padding of 32)
    interpolation: str = "bilinear"  # a PIL resampling filter name
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    @property
    def mean_array(self) -> np.ndarray:
        return np.asarray(self.mean, np.float32)

    @property
    def std_array(self) -> np.ndarray:
        return np.asarray(self.std, np.float32)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    version: str
    preprocess: PreprocessSpec
    labels: tuple[str, ...]
    onnx_sha256: str
    source: str  # where the weights came from, for humans
    export_format: int = 1  # EXPORT_FORMAT when written; model.json without it: 1
    embedding_dim: int = 0  # width of the `embedding` output; 0: logits only
    weights_sha256: str = ""  # digest of the weights exported (engines.export.weights_digest)
    program_sha256: str = ""  # digest of model.pt2 ("": none exported, or an older export)

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def embedding_space(self) -> str:
        """Names the space the vectors live in: vectors compare only within one. Any other
        model, version or weights give another (empty: no embedding output)."""
        if not self.embedding_dim:
            return ""
        return f"{self.name}/{self.version}/sha256:{self.weights_sha256[:16]}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        raw = json.loads(text)
        pre = raw.pop("preprocess")
        pre = PreprocessSpec(**{**pre, "mean": tuple(pre["mean"]), "std": tuple(pre["std"])})
        return cls(preprocess=pre, labels=tuple(raw.pop("labels")), **raw)


@dataclass(frozen=True)
class ModelRef:
    """A resolved model version on disk: its directory and its spec."""

    path: Path
    spec: ModelSpec

    @property
    def onnx_path(self) -> Path:
        return self.path / ONNX_FILE

    @property
    def torch_path(self) -> Path:
        return self.path / TORCH_FILE

    def changed_since_export(self, path: Path) -> str:
        """Why `path` (model.onnx or model.pt2) is not the file model.json names ("": it is,
        or model.json names no digest for it). An edited file may still load, and answer
        nonsense."""
        field = {ONNX_FILE: "onnx_sha256", TORCH_FILE: "program_sha256"}[path.name]
        digest = getattr(self.spec, field)
        if not digest or sha256_file(path) == digest:
            return ""
        return (
            f"{path} is not the file its model.json names ({field} {digest[:16]}...): "
            f"changed since export; export the version again"
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_entry_name(name: str) -> bool:
    """Whether `name` can be a model or version directory of the repository: one path
    component ("..", "a/b" or a name past NAME_MAX would read outside it, or fail)."""
    return (
        0 < len(name.encode()) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\0")
    )


def list_versions(root: Path, name: str) -> list[str]:
    if not is_entry_name(name):
        return []
    model_dir = Path(root) / name
    if not model_dir.is_dir():
        return []
    versions = [p.name for p in model_dir.iterdir() if (p / SPEC_FILE).is_file()]
    return sorted(versions, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))


def resolve(root: Path, name: str, version: str = "") -> ModelRef:
    """Find `name` (at `version`, or its highest version) in the repository at `root`."""
    root = Path(root)
    versions = list_versions(root, name)
    if not versions:
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise ModelNotFoundError(
            f"model {name!r} not found in repository {str(root)!r} (has: {known or 'nothing'}); "
            f"run `raystream export` to create it"
        )
    version = version or versions[-1]
    if version not in versions:
        raise ModelNotFoundError(f"model {name!r} has no version {version!r} (has: {versions})")
    path = root / name / version
    spec = ModelSpec.from_json((path / SPEC_FILE).read_text())
    # The directories name the version, as in Triton's repository: a version directory
    # copied by hand keeps the model.json of the one it was copied from.
    return ModelRef(path=path, spec=replace(spec, name=name, version=version))


def select_versions(
    root: Path, name: str, latest: int | None = None, versions: tuple[str, ...] = ()
) -> list[str]:
    """The versions of `name` a version policy picks: those listed (each must exist), or the
    `latest` N in the repository (default 1), lowest first."""
    have = list_versions(root, name)
    if not have:  # what clients read (a load's NOT_FOUND): no path of the server's
        raise ModelNotFoundError(
            f"model {name!r} is not in the model repository (has: {list_models(root) or 'nothing'})"
        )
    if latest is not None and latest < 1:
        raise ValueError(f"a version policy's latest must be 1 or more, got {latest}")
    if versions:
        missing = [v for v in versions if v not in have]
        if missing:
            raise ModelNotFoundError(f"model {name!r} has no version {missing} (has: {have})")
        return sorted(set(versions), key=have.index)
    return have[-(latest or 1) :]


def list_models(root: Path) -> list[str]:
    """Every model in the repository at `root`, by name."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if list_versions(root, p.name))
