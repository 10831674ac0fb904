"""Every CPU decode path against the model's reference preprocessing (tests/fidelity.py): PIL
with and without DCT scaling, and the GPU path's resize and crop run on CPU tensors (torch's
antialiased interpolation in PIL's two rounded passes, what `decode: gpu` uses without
Triton; engines/crop_kernel.py computes the same pixels)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fidelity import MIN_COSINE, Reference, fidelity_set
from PIL import Image, ImageOps

from engines import images
from engines.jpeg import nvjpeg_size


@pytest.fixture(scope="module")
def reference(model) -> Reference:
    return Reference(model, fidelity_set())


def test_the_set_covers_every_class_and_dct_scaling(model, reference) -> None:
    """The set holds what it is for: JPEGs the CPU decode scales by 1/2 and 1/4, and some it
    leaves whole, in every class; photos nvJPEG takes and photos it leaves to the CPU."""
    spec = model.spec.preprocess
    scales = set()
    for sample in reference.samples:
        with Image.open(io.BytesIO(sample.data)) as image:
            if image.format == "JPEG":
                scales.add(images.dct_scale(*image.size, spec))
    assert scales == {1, 2, 4}
    kinds = {s.kind for s in reference.samples}
    assert kinds >= {"2/4/8x crop", "2/4/8x resize", "odd", "grayscale", "progressive"}
    assert kinds >= {"EXIF-rotated", "PNG", "own size", "mosaic"}
    on_gpu = [nvjpeg_size(s.data, spec.resize_size) is not None for s in reference.samples]
    assert any(on_gpu) and not all(on_gpu)


def test_cpu_decode_matches_the_reference(model, reference) -> None:
    spec = model.spec.preprocess
    fidelity = reference.check("cpu", lambda data: images.decode(data, spec))
    assert not fidelity.failures(), "\n".join(fidelity.failures())


def test_cpu_decode_without_dct_scaling_matches_the_reference(
    model, reference, monkeypatch
) -> None:
    monkeypatch.setattr(images, "DCT_HEADROOM", 1 << 20)  # no JPEG is DCT-scaled
    spec = model.spec.preprocess
    fidelity = reference.check("cpu, no DCT scaling", lambda data: images.decode(data, spec))
    assert not fidelity.failures(), "\n".join(fidelity.failures())


def test_dct_scaling_to_the_resize_size_would_not_match(model, reference) -> None:
    """The check tells: JPEGs DCT-scaled to a short side of the resize size (the CPU decode
    before DCT_HEADROOM) fall under MIN_COSINE."""
    spec = model.spec.preprocess

    def drafted(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", (spec.resize_size, spec.resize_size))
            image = ImageOps.exif_transpose(image).convert("RGB")
            return images.crop_to_input(image, spec)

    fidelity = reference.check("draft to the resize size", drafted)
    assert fidelity.min_by_kind()["2/4/8x resize"] < MIN_COSINE


def test_gpu_resize_on_cpu_tensors_matches_the_reference(model, reference) -> None:
    """decode: gpu's resize and crop (engines/gpu_decode.py, torch's operators) on PIL's full
    decodes of the JPEGs nvJPEG takes; nvJPEG's own decode: tests/gpu/test_gpu_fidelity.py."""
    import torch

    from engines.gpu_decode import crop_batch

    spec = model.spec.preprocess
    chosen = [i for i, s in enumerate(reference.samples) if nvjpeg_size(s.data, spec.resize_size)]
    decoded = []
    for index in chosen:
        with Image.open(io.BytesIO(reference.samples[index].data)) as image:
            pixels = np.asarray(image.convert("RGB"))
        decoded.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1))
    crops = crop_batch(decoded, spec).numpy()
    fidelity = reference.compare("gpu resize on cpu", crops, chosen)
    assert not fidelity.failures(), "\n".join(fidelity.failures())
