"""Resize and center-crop a request's decoded JPEGs on the GPU in one kernel launch.

Without it, `engines.gpu_decode.crop_batch` resizes with `F.interpolate` (bilinear,
antialiased) per distinct image size, then crops, rounds and scatters the rows: ten or more
kernel launches per size, each a chance to queue behind the other replicas' work on a shared
GPU. For 8 photos of mixed sizes that took 1.5 ms of the decode stage's 3.4 (in one pass; 12
processes under MPS at 5,000 img/s, `bench/decode_procs.py --gap-ms 15`, one H100). This
kernel reads every image where nvJPEG left it (a table of device pointers) and writes the
(N, S, S, 3) uint8 crops directly. Each output pixel is computed as PIL's `resize(BILINEAR)`
computes it, the model's reference preprocessing: a horizontal pass whose rows are rounded
to bytes, then a vertical pass over those rows, rounded again, halves up, with the triangle
filter's weights (PIL's and PyTorch's antialiased bilinear agree; PIL's are fixed-point,
these float, so where a sum lands on an exact half the two can round a grey level apart).
Its pixels equal `crop_batch`'s torch path within one grey level (float sums in another
order; tests/gpu/test_nvjpeg.py).

Triton compiles it on first use (the decoder's warm-up) and caches it on disk. Where Triton
does not import or cannot build the kernel (no C compiler for its launcher, say),
`available()` is False, says why in the log, and the torch path runs. With
`TRITON_INTERPRET=1` it runs on CPU tensors (slowly), which is how it can be checked without
a GPU.
"""

from __future__ import annotations

import functools
import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: torch's CPU wheel comes without Triton
    triton = None

logger = logging.getLogger(__name__)

BLOCK = 256  # output pixels per program


@functools.cache
def available(crop: int) -> bool:
    """Triton imports, and the kernel for crops of this size builds and runs on the current
    GPU: checked once per process and size, on a grey image, by the first caller (the
    decoder's warm-up)."""
    if triton is None:
        return False
    try:
        device = torch.cuda.current_device()
        grey = torch.full((3, crop + 8, crop + 16), 128, dtype=torch.uint8, device=device)
        crops = resize_crop([grey], [(crop + 4, crop + 8)], crop)
        return bool((crops == 128).all().item())
    except Exception:
        logger.warning(
            "the one-launch resize and crop does not run here; torch's interpolation will",
            exc_info=True,
        )
        return False


def resize_crop(
    images: list[torch.Tensor], sizes: list[tuple[int, int]], crop: int
) -> torch.Tensor:
    """(3, H, W) contiguous uint8 images on the current CUDA device, each resized to `sizes[i]`
    ((height, width), both >= crop) and center-cropped to crop x crop: (N, crop, crop, 3)
    uint8. Runs on the current stream; the images must stay alive until it has run.

    A launch loops over the largest window of its images, so images whose windows differ
    by more than twofold (a 6000-pixel photo among catalogue thumbnails) go in launches of
    their own, grouped by window size: one launch for the usual mix of photos."""
    for image, (height, width) in zip(images, sizes, strict=True):
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"images must be (3, H, W) uint8, got {image.dtype} {image.shape}")
        if not image.is_contiguous():
            raise ValueError("images must be contiguous (the kernel reads them as planes)")
        if min(height, width) < crop:
            raise ValueError(f"a {height}x{width} resize is smaller than the {crop} crop")
    taps = [
        (_taps(image.shape[1], height), _taps(image.shape[2], width))
        for image, (height, width) in zip(images, sizes, strict=True)
    ]
    groups: dict[int, list[int]] = {}
    for index, (taps_y, taps_x) in enumerate(taps):
        groups.setdefault(max(8, 1 << (max(taps_y, taps_x) - 1).bit_length()), []).append(index)
    order = [index for indices in groups.values() for index in indices]
    rows = [(images[i].data_ptr(), *images[i].shape[1:], *sizes[i], i) for i in order]
    device = images[0].device
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":  # up from pinned memory: from pageable the copy waits
        table = table.pin_memory().to(device, non_blocking=True)
    out = torch.empty((len(images), crop, crop, 3), dtype=torch.uint8, device=device)
    first = 0
    for indices in groups.values():
        taps_y = max(taps[i][0] for i in indices)
        taps_x = max(taps[i][1] for i in indices)
        grid = (triton.cdiv(crop * crop, BLOCK), len(indices))
        group_rows = table[first : first + len(indices)]
        _resize_crop[grid](group_rows, out, taps_y, taps_x, S=crop, BLOCK=BLOCK)
        first += len(indices)
    return out


def _taps(source: int, resized: int) -> int:
    """Source pixels along one axis that an output pixel's window can span, and one more:
    the filter's support is the scale (at least 1) on either side."""
    return int(2.0 * max(source / resized, 1.0)) + 2


if triton is not None:

    @triton.jit
    def _axis(out_index, top, scale):
        """Where output index `out_index` of the crop reads along one axis: the window's
        centre, first index and the filter's support and inverse scale (PyTorch's
        `_compute_indices_min_size_weights_aa`, align_corners=False)."""
        center = scale * ((out_index + top).to(tl.float32) + 0.5)
        support = tl.where(scale >= 1.0, scale, 1.0)
        invscale = tl.where(scale >= 1.0, 1.0 / scale, 1.0)
        first = tl.maximum((center - support + 0.5).to(tl.int32), 0)  # C++'s truncation
        end = (center + support + 0.5).to(tl.int32)
        return center, first, end, invscale

    @triton.jit
    def _weight(index, center, invscale, end):
        """The triangle filter's weight of source index `index` (0 past the window)."""
        w = tl.maximum(1.0 - tl.abs((index.to(tl.float32) - center + 0.5) * invscale), 0.0)
        return tl.where(index < end, w, 0.0)

    @triton.jit
    def _to_u8(value):
        """Rounded halves up, as PIL's fixed-point sums round, and clamped to a byte (kept
        as a float: the horizontal pass's rows feed the vertical pass)."""
        return tl.minimum(tl.maximum(tl.floor(value + 0.5), 0.0), 255.0)

    # the windows' sizes change from call to call: not compiled apart when one is 1 or a
    # multiple of 16, as Triton does for integer arguments by default
    @triton.jit(do_not_specialize=["taps_y", "taps_x"])
    def _resize_crop(table, out, taps_y, taps_x, S: tl.constexpr, BLOCK: tl.constexpr):
        """One program: BLOCK output pixels of the image in row program_id(1) of `table`
        (its pointer, height, width, resized height and width, and its row of `out`)."""
        pixel = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = pixel < S * S
        oy, ox = pixel // S, pixel % S
        row = table + tl.program_id(1) * 6
        base = tl.load(row).to(tl.pointer_type(tl.uint8))
        height, width = tl.load(row + 1).to(tl.int32), tl.load(row + 2).to(tl.int32)
        new_h, new_w = tl.load(row + 3).to(tl.int32), tl.load(row + 4).to(tl.int32)
        scale_y = height.to(tl.float32) / new_h.to(tl.float32)
        scale_x = width.to(tl.float32) / new_w.to(tl.float32)
        cy, y0, y_end, inv_y = _axis(oy, (new_h - S) // 2, scale_y)
        cx, x0, x_end, inv_x = _axis(ox, (new_w - S) // 2, scale_x)
        y_end = tl.minimum(y_end, height)  # the loops run the launch's widest window;
        x_end = tl.minimum(x_end, width)  # each pixel's own ends at these
        total_x = tl.zeros((BLOCK,), tl.float32)
        for j in range(0, taps_x):
            total_x += _weight(x0 + j, cx, inv_x, x_end)
        inv_total_x = 1.0 / total_x
        plane = height * width
        r = tl.zeros((BLOCK,), tl.float32)
        g = tl.zeros((BLOCK,), tl.float32)
        b = tl.zeros((BLOCK,), tl.float32)
        total_y = tl.zeros((BLOCK,), tl.float32)
        for k in range(0, taps_y):
            y = y0 + k
            wy = _weight(y, cy, inv_y, y_end)
            total_y += wy
            row_r = tl.zeros((BLOCK,), tl.float32)
            row_g = tl.zeros((BLOCK,), tl.float32)
            row_b = tl.zeros((BLOCK,), tl.float32)
            for j in range(0, taps_x):
                x = x0 + j
                wx = _weight(x, cx, inv_x, x_end)
                valid = inside & (y < y_end) & (x < x_end)
                at = base + y * width + x
                row_r += wx * tl.load(at, mask=valid, other=0).to(tl.float32)
                row_g += wx * tl.load(at + plane, mask=valid, other=0).to(tl.float32)
                row_b += wx * tl.load(at + 2 * plane, mask=valid, other=0).to(tl.float32)
            # the horizontal pass's row, a byte as PIL stores it, then its vertical weight
            r += wy * _to_u8(row_r * inv_total_x)
            g += wy * _to_u8(row_g * inv_total_x)
            b += wy * _to_u8(row_b * inv_total_x)
        norm = 1.0 / total_y
        dest = out + tl.load(row + 5) * (S * S * 3) + pixel * 3
        tl.store(dest, _to_u8(r * norm).to(tl.uint8), mask=inside)
        tl.store(dest + 1, _to_u8(g * norm).to(tl.uint8), mask=inside)
        tl.store(dest + 2, _to_u8(b * norm).to(tl.uint8), mask=inside)
