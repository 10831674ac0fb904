"""engines/jpeg.py against PIL: the JPEGs it sends to nvJPEG are the ones PIL reads as plain
8-bit RGB or grayscale JPEGs, at PIL's size; everything else goes to the CPU path."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from engines.jpeg import gpu_size, nvjpeg_size

from conftest import encode


def _jpeg(mode: str = "RGB", size=(64, 48), **params) -> bytes:
    image = Image.new(mode, size, "white" if mode != "CMYK" else (0, 0, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **params)
    return buffer.getvalue()


def _with_orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return _jpeg(exif=exif.tobytes())


def test_real_photos_go_to_the_gpu_at_their_size(photos) -> None:
    for data in photos.values():
        with Image.open(io.BytesIO(data)) as image:
            assert gpu_size(data) == image.size


def test_jpegs_smaller_than_the_resize_size_go_to_the_cpu() -> None:
    assert nvjpeg_size(_jpeg(size=(512, 256)), 256) == (512, 256)
    assert nvjpeg_size(_jpeg(size=(300, 200)), 256) is None  # enlarged: the CPU path
    assert nvjpeg_size(_jpeg("CMYK", size=(512, 512)), 256) is None


@pytest.mark.parametrize(
    "data",
    [
        _jpeg(),
        _jpeg("L"),
        _jpeg(progressive=True),
        _jpeg(size=(3000, 7)),
        _with_orientation(1),
        _jpeg(quality=5, subsampling=0),
    ],
    ids=["rgb", "gray", "progressive", "thin", "upright-exif", "444"],
)
def test_plain_jpegs_go_to_the_gpu(data: bytes) -> None:
    with Image.open(io.BytesIO(data)) as image:
        assert gpu_size(data) == image.size


@pytest.mark.parametrize(
    "data",
    [
        _jpeg("CMYK"),
        _with_orientation(6),  # rotated: the CPU path applies the rotation
        _jpeg()[:-50],  # truncated: nvJPEG would decode it without an error
        encode(np.zeros((8, 8, 3), np.uint8), "PNG"),
        b"",
        b"\xff\xd8\xff\xd9",
        b"\xff\xd8" + b"\xff" * 100,
    ],
    ids=["cmyk", "rotated", "truncated", "png", "empty", "no-frame", "fill-only"],
)
def test_anything_else_goes_to_the_cpu_path(data: bytes) -> None:
    assert gpu_size(data) is None


def test_mangled_headers_never_raise(photos) -> None:
    """Random damage to a real photo's header: an answer, never an exception."""
    rng = random.Random(0)
    original = bytearray(next(iter(photos.values())))
    for _ in range(2000):
        data = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(2, 600)] = rng.randrange(256)
        size = gpu_size(bytes(data))
        assert size is None or (size[0] > 0 and size[1] > 0)
