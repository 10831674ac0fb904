"""INT8 calibration data: a folder of representative images through the model's own
preprocessing, in fixed-size float32 batches. TensorRT-independent and tested on the CPU."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from engines.base import normalize
from engines.images import InvalidImage, decode
from engines.repository import PreprocessSpec

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def calibration_images(folder: Path, limit: int = 512) -> list[Path]:
    paths = sorted(
        p for p in Path(folder).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    )
    if not paths:
        raise FileNotFoundError(f"no calibration images (JPEG/PNG/...) under {folder}")
    return paths[:limit]


def calibration_batches(
    paths: list[Path], spec: PreprocessSpec, batch_size: int
) -> Iterator[np.ndarray]:
    """Float32 (batch_size, 3, H, W) batches; the last batch is completed by cycling from the
    start, so every batch has the calibration profile's exact shape. Unreadable images are
    skipped with a warning."""
    crops = []
    for path in paths:
        try:
            crops.append(decode(path.read_bytes(), spec))
        except InvalidImage as exc:
            logger.warning("calibration: skipping %s: %s", path, exc)
    if not crops:
        raise ValueError("none of the calibration images could be decoded")
    count = -(-len(crops) // batch_size) * batch_size
    cycled = list(itertools.islice(itertools.cycle(crops), count))
    for start in range(0, count, batch_size):
        batch = np.stack(cycled[start : start + batch_size])
        yield normalize(batch, spec.mean_array, spec.std_array)
