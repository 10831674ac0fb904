"""Decode, resize and center-crop images per the model's PreprocessSpec: the image policy the
server's stages and the engines' tools (export checks, INT8 calibration) share.

Pure functions over bytes, PIL images and numpy arrays: no Ray, no gRPC. The policies:
- formats: JPEG, PNG, WebP, BMP, GIF, TIFF (MPO = multi-picture JPEG); others are rejected;
- multi-frame images (animated GIF/WebP/PNG, multi-page TIFF): the first frame is classified;
- EXIF orientation is applied, so a phone photo is classified the way it is displayed;
- any colour mode (grayscale, CMYK, palette, 16-bit, alpha) is converted to RGB; alpha is
  composited onto white (product photos are shot on white);
- decompression bombs: the pixel count from the header is checked before anything is decoded;
- large JPEGs are decoded with DCT scaling (`draft`), but only while the short side stays at
  least DCT_HEADROOM times the resize size: the model then sees what a full decode would give
  it (see DCT_HEADROOM).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from engines.repository import PreprocessSpec

__all__ = [
    "DecodeLimits",
    "InvalidImage",
    "crop_to_input",
    "dct_scale",
    "decode",
    "decode_cost",
    "open_checked",
]

ALLOWED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "GIF", "TIFF"})
JPEG_FORMATS = ("JPEG", "MPO")
# A JPEG is DCT-scaled (1/2, 1/4, 1/8) only while its short side stays at least this many
# times the resize size. DCT scaling filters otherwise than the bilinear resize of the
# reference preprocessing (full decode, bilinear resize, crop): scaled to the resize size
# itself, a 512x512 photo's embedding fell to cosine 0.96 of the reference's; with 2x left for
# the resize 0.995-0.997, 3x 0.998-0.999, 4x 0.9993 or more (tests/fidelity.py's photos).
DCT_HEADROOM = 4
TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})  # EXIF orientations that swap the sides


class InvalidImage(ValueError):
    """One image cannot be used (its message says why); it fails alone, the rest of its
    request goes on. The server answers it with INVALID_ARGUMENT: its table of status codes
    maps this class, and `code` is that status for the stages that record it directly."""

    code = 3  # google.rpc.Code.INVALID_ARGUMENT


@dataclass(frozen=True)
class DecodeLimits:
    max_image_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # width * height, checked before decoding


def open_checked(data: bytes, limits: DecodeLimits = DecodeLimits()) -> Image.Image:
    """Parse the header only and enforce the limits: size in bytes, format, pixel count
    (before any pixel is decoded). Raises InvalidImage naming the problem."""
    if not data:
        raise InvalidImage("image is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise InvalidImage(
            f"image is {len(data)} bytes, over the limit of {limits.max_image_bytes} bytes"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise InvalidImage(_why_unreadable(data)) from None
    except Image.DecompressionBombError as exc:  # past PIL's own bound, before this one's
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{declared[1]} pixels" if declared else "more pixels than PIL opens"
        raise InvalidImage(f"image declares {size}; allowed 1..{limits.max_pixels}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # found by the fuzz test
        raise InvalidImage(f"image header is corrupt or truncated: {exc}") from None
    if image.format not in ALLOWED_FORMATS:
        image.close()
        raise InvalidImage(
            f"image format {image.format} is not supported "
            f"(supported: {', '.join(sorted(ALLOWED_FORMATS))})"
        )
    width, height = image.size
    if width * height > limits.max_pixels or width == 0 or height == 0:
        image.close()
        raise InvalidImage(
            f"image is {width}x{height} = {width * height} pixels; allowed 1.."
            f"{limits.max_pixels} pixels"
        )
    return image


def _why_unreadable(data: bytes) -> str:
    """Why PIL identified no image in `data`: a known format's header with content its
    decoder refuses (it says why), or no known header at all."""
    Image.init()
    for name in sorted(ALLOWED_FORMATS):
        factory, accept = Image.OPEN.get(name, (None, None))
        if factory is None or (accept is not None and not accept(data[:16])):
            continue
        try:
            factory(io.BytesIO(data), None).close()
        except Exception as exc:  # the plugin's own reason, whatever its type
            return (
                f"{name} image that cannot be decoded ({exc or type(exc).__name__}); "
                f"re-encode it, e.g. as 8-bit RGB JPEG or PNG"
            )
    return f"not a supported image ({len(data)} bytes, no JPEG/PNG/WebP/BMP/GIF/TIFF header found)"


def decode_cost(data: bytes, spec: PreprocessSpec, limits: DecodeLimits = DecodeLimits()) -> int:
    """The pixels decoding `data` will produce, from its header: a JPEG's after the DCT
    scaling `decode` asks for (see dct_scale). Raises InvalidImage as `open_checked` does."""
    with open_checked(data, limits) as image:
        width, height = image.size
        scale = dct_scale(width, height, spec) if image.format in JPEG_FORMATS else 1
        return -(-width // scale) * -(-height // scale)


def dct_scale(width: int, height: int, spec: PreprocessSpec) -> int:
    """The DCT scaling denominator (1, 2, 4 or 8) `decode` asks for a JPEG of this size: the
    largest that leaves its short side at least DCT_HEADROOM * resize_size (PIL's `draft`
    picks it from the size asked for, as here)."""
    fits = min(width, height) // (DCT_HEADROOM * spec.resize_size)
    return next((scale for scale in (8, 4, 2) if fits >= scale), 1)


def decode(data: bytes, spec: PreprocessSpec, limits: DecodeLimits = DecodeLimits()) -> np.ndarray:
    """Encoded image bytes -> uint8 (H, W, 3) crop; raises InvalidImage naming the problem."""
    with open_checked(data, limits) as image:
        try:
            full_width, full_height = image.size
            if image.format in JPEG_FORMATS:
                least = DCT_HEADROOM * spec.resize_size
                image.draft("RGB", (least, least))
            image.load()  # first frame only for multi-frame images
            if image.getexif().get(ExifTags.Base.Orientation) in TRANSPOSING_ORIENTATIONS:
                full_width, full_height = full_height, full_width
            ImageOps.exif_transpose(image, in_place=True)
            return crop_to_input(_to_rgb(image), spec, (full_width, full_height))
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
            raise InvalidImage(
                f"{image.format} image data is corrupt or truncated: {exc}"
            ) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: scale to 8 bits by the image's own range.
        array = np.asarray(image, dtype=np.float64)
        top = array.max() or 1.0
        image = Image.fromarray((array * (255.0 / top)).astype(np.uint8))
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        return background
    return image.convert("RGB")


def crop_to_input(
    image: Image.Image, spec: PreprocessSpec, full_size: tuple[int, int] | None = None
) -> np.ndarray:
    """Resize the shorter side to `resize_size`, center-crop `input_size`: uint8 (H, W, 3).

    full_size: the (width, height) of the full decode when `image` is a DCT-scaled one (its
    pixels 1/2, 1/4 or 1/8 of the full decode's, its last column and row partly padding):
    the crop's geometry is the full decode's, so the crop shows what it would show.

    One `resize` call with a source `box` computes only the pixels of the crop (the filter
    still reads the pixels around the box), instead of resizing the whole image and cutting
    it: the same pixels to within a grey level. No `reducing_gap`: its box-filter shrink by
    whole factors took a 1536x1536 photo's embedding to cosine 0.9975 of the reference's.
    """
    if image.mode != "RGB":
        image = image.convert("RGB")  # (convert copies even an RGB image)
    width, height = full_size or image.size
    reduction = round(width / image.width)  # DCT scales are whole: 1, 2, 4 or 8
    scale = spec.resize_size / min(width, height)
    new_w = max(spec.input_size, round(width * scale))
    new_h = max(spec.input_size, round(height * scale))
    left, top = (new_w - spec.input_size) // 2, (new_h - spec.input_size) // 2
    # resized -> source coordinates (of the image at hand)
    sx, sy = width / new_w / reduction, height / new_h / reduction
    box = (left * sx, top * sy, (left + spec.input_size) * sx, (top + spec.input_size) * sy)
    resample = Image.Resampling[spec.interpolation.upper()]
    size = (spec.input_size, spec.input_size)
    return np.asarray(image.resize(size, resample, box=box), dtype=np.uint8)
