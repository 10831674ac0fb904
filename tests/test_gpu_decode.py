"""decode: gpu — the CPU side (header checks, routing) everywhere; nvJPEG itself on GPUs."""

from __future__ import annotations

import importlib.util
import io

import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.config import AppConfig
from serve_app.stages import Preprocessor

from conftest import encode

HAS_GPU_DECODE = importlib.util.find_spec("torchvision") is not None and torch.cuda.is_available()


def _preprocessor(model_repository, decode: str) -> Preprocessor:
    return Preprocessor(AppConfig(model_repository=model_repository, decode=decode))


async def test_gpu_mode_passes_plain_jpegs_on_encoded(model_repository, photos) -> None:
    png = encode(np.asarray(Image.open(io.BytesIO(photos["coffee"]))), "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = encode(
        np.asarray(Image.open(io.BytesIO(photos["coffee"]))), "JPEG", exif=exif.tobytes()
    )
    truncated = photos["chelsea"][: len(photos["chelsea"]) // 3]
    images = [photos["chelsea"], png, b"junk", rotated, photos["coffee"], truncated]
    pre = await _preprocessor(model_repository, "gpu").run(images)
    assert pre.jpeg_indices == (0, 4) and pre.jpegs == (photos["chelsea"], photos["coffee"])
    assert pre.indices == (1, 3)  # PNG and the EXIF-rotated JPEG decode on the CPU
    # Truncated JPEGs stay on the CPU path, which reports them (nvJPEG does not).
    assert [f.index for f in pre.failures] == [2, 5]
    assert "truncated" in pre.failures[1].message
    cpu = await _preprocessor(model_repository, "cpu").run(images)
    assert cpu.jpegs == () and cpu.indices == (0, 1, 3, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_DECODE, reason="needs a CUDA GPU and torchvision (nvJPEG)")
def test_nvjpeg_crops_match_the_cpu_path(model, photos) -> None:
    from serve_app.gpu_decode import GpuJpegDecoder
    from serve_app.preprocessing import DecodeLimits, decode

    spec = model.spec.preprocess
    decoder = GpuJpegDecoder(spec, DecodeLimits())
    jpegs = [photos[n] for n in ("chelsea", "coffee", "astronaut", "rocket")]
    for jpeg, crop in zip(jpegs, decoder.crops(jpegs), strict=True):
        reference = decode(jpeg, spec).astype(np.int16)
        assert crop.shape == (224, 224, 3) and crop.dtype == np.uint8
        assert np.abs(crop.astype(np.int16) - reference).mean() < 3.0
    # A JPEG nvJPEG rejects fails alone, with the CPU path's message.
    good, bad = decoder.crops([jpegs[0], b"\xff\xd8\xff\xdb" + b"\x00" * 64 + b"\xff\xd9"])
    assert isinstance(good, np.ndarray) and isinstance(bad, Exception)


def test_crops_batched_by_size_equal_one_at_a_time(model, photos) -> None:
    """The GPU path's resize + crop, run here on CPU tensors: grouping images of one size
    into one call changes nothing, and the crops match the CPU path's."""
    from serve_app.gpu_decode import crop_batch
    from serve_app.preprocessing import decode

    spec = model.spec.preprocess
    names = ["chelsea", "coffee", "chelsea", "astronaut", "coffee"]  # repeated sizes group
    images = [
        torch.from_numpy(np.array(Image.open(io.BytesIO(photos[n])).convert("RGB")))
        .permute(2, 0, 1)
        .contiguous()
        for n in names
    ]
    batched = crop_batch(images, spec)
    assert batched.shape == (5, 3, 224, 224) and batched.dtype == torch.uint8
    for image, crop, name in zip(images, batched, names, strict=True):
        assert torch.equal(crop_batch([image], spec)[0], crop)
        reference = decode(photos[name], spec).astype(np.int16)
        assert np.abs(crop.permute(1, 2, 0).numpy().astype(np.int16) - reference).mean() < 3.0
