"""Decode/resize/crop/normalize against reference computations, and the bad-input policy."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from engines.base import normalize
from engines.images import DecodeLimits, InvalidImage, crop_to_input, decode
from engines.repository import PreprocessSpec

from conftest import encode

SPEC = PreprocessSpec()


def test_crop_geometry_matches_reference() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)  # H=300, W=400
    got = crop_to_input(Image.fromarray(image), SPEC)
    # Reference: shorter side 300 -> 256 means 400 -> round(400 * 256 / 300) = 341.
    resized = np.asarray(Image.fromarray(image).resize((341, 256), Image.Resampling.BILINEAR))
    expected = resized[16:240, 58:282]  # (256 - 224) // 2 = 16, (341 - 224) // 2 = 58
    assert got.shape == (224, 224, 3) and got.dtype == np.uint8
    # crop_to_input resizes only the crop's box: the same pixels to within one grey level.
    np.testing.assert_allclose(got.astype(int), expected.astype(int), atol=1)
    assert (got != expected).mean() < 0.01


def test_crop_keeps_the_center() -> None:
    image = np.zeros((600, 1000, 3), np.uint8)
    image[250:350, 450:550] = (255, 0, 0)  # red square at the center
    image[:, :100] = (0, 255, 0)  # green band that the center crop must cut away
    got = crop_to_input(Image.fromarray(image), SPEC)
    assert tuple(got[112, 112]) == (255, 0, 0)
    assert not (got[..., 1] > 128).any()


def test_normalize_matches_reference() -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    mean, std = np.array(SPEC.mean), np.array(SPEC.std)
    expected = ((images / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    got = normalize(images, SPEC.mean_array, SPEC.std_array)
    assert got.dtype == np.float32 and got.shape == (3, 3, 8, 8) and got.flags.c_contiguous
    np.testing.assert_allclose(got, expected, atol=1e-5)
    # the float32 operations of the plain form (convert, scale, shift, then transpose):
    # the same values, bit for bit, whatever the order of the copy
    scale = (1.0 / (255.0 * SPEC.std_array)).astype(np.float32)
    shift = (-SPEC.mean_array / SPEC.std_array).astype(np.float32)
    plain = (images.astype(np.float32) * scale + shift).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(got, plain)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF"])
def test_formats_decode(photos: dict[str, bytes], fmt: str) -> None:
    array = np.asarray(Image.open(io.BytesIO(photos["coffee"])).convert("RGB"))
    crop = decode(encode(array, fmt), SPEC)
    assert crop.shape == (224, 224, 3)


@pytest.mark.parametrize("mode", ["L", "CMYK", "RGBA", "P", "I;16", "LA"])
def test_colour_modes_become_rgb(photos: dict[str, bytes], mode: str) -> None:
    image = Image.open(io.BytesIO(photos["chelsea"])).convert("RGB")
    if mode == "I;16":
        image = Image.fromarray(np.asarray(image.convert("L"), np.uint16) * 257)
    else:
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format="TIFF" if mode in ("CMYK", "I;16") else "PNG")
    assert decode(buffer.getvalue(), SPEC).shape == (224, 224, 3)


def test_exif_orientation_is_applied() -> None:
    # A 400x200 landscape image, left half black, stored with orientation 6 (rotate 90 CW).
    array = np.full((200, 400, 3), 255, np.uint8)
    array[:, :200] = 0
    exif = Image.Exif()
    exif[0x0112] = 6
    crop = decode(encode(array, "JPEG", exif=exif.tobytes(), quality=95), SPEC)
    # Displayed upright it is portrait with the black half on top.
    assert crop[10, 112].mean() < 40 and crop[-10, 112].mean() > 215


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (bytes(np.random.default_rng(2).integers(0, 256, 5000, dtype=np.uint8)), "not a supported"),
        (_png_header_only(7_000, 7_000), r"7000x7000 = 49000000 pixels; allowed 1\.\.40000000"),
        # past PIL's own bound too: still the configured limit quoted, not PIL's
        (_png_header_only(50_000, 50_000), r"2500000000 pixels; allowed 1\.\.40000000$"),
    ],
)
def test_bad_images_are_invalid_argument(data: bytes, message: str) -> None:
    with pytest.raises(InvalidImage, match=message) as info:
        decode(data, SPEC)
    assert info.value.code == 3


def test_truncated_or_corrupt_jpeg_is_invalid(photos: dict[str, bytes]) -> None:
    jpeg = photos["chelsea"]
    with pytest.raises(InvalidImage, match="corrupt or truncated"):
        decode(jpeg[: len(jpeg) // 2], SPEC)
    with pytest.raises(InvalidImage, match="corrupt or truncated"):
        decode(jpeg[:600] + b"\x13" * 20000, SPEC)  # a valid header, a corrupt body


def test_size_limit() -> None:
    with pytest.raises(InvalidImage, match="over the limit of 100 bytes"):
        decode(b"x" * 101, SPEC, DecodeLimits(max_image_bytes=100))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=4096), cut=st.integers(0, 20000), flip=st.integers(0, 255))
def test_no_input_escapes_the_error_policy(photos_for_fuzz, data, cut, flip) -> None:
    """Fuzz: random bytes, and real JPEG/PNG bytes cut short or with one byte changed, either
    decode to a crop or raise InvalidImage (code 3): never another exception."""
    jpeg, png = photos_for_fuzz
    corrupted = bytearray(jpeg)
    corrupted[min(cut, len(corrupted) - 1)] = flip
    for candidate in (data, jpeg[:cut], png[:cut], bytes(corrupted), png[:8] + data):
        try:
            crop = decode(candidate, SPEC)
        except InvalidImage as exc:
            assert exc.code == 3 and str(exc)
        else:
            assert crop.shape == (224, 224, 3) and crop.dtype == np.uint8


@pytest.fixture(scope="module")
def photos_for_fuzz() -> tuple[bytes, bytes]:
    small = np.asarray(Image.new("RGB", (64, 48), (200, 30, 90)))
    return encode(small, "JPEG"), encode(small, "PNG")
