"""JPEG decode, resize and center-crop on the GPU (batched nvJPEG through torchvision).

PIL on 16 cores caps near 7,000 small photos/s (../shared/FINDINGS.md) while batched nvJPEG
decodes 35,000/s on the same box. With `decode: gpu`, the CPU stage only parses headers and
enforces the limits (serve_app/preprocessing.open_checked); JPEGs that `gpu_decodable()`
accepts travel as bytes to the inference replica, which decodes them here. Anything nvJPEG
rejects is decoded again on the CPU, so its error message is the CPU path's.

Resizing uses bilinear interpolation with antialiasing, as PIL does; results match the CPU
path to within a few grey levels, not bit for bit (tests/test_gpu_decode.py).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from engines.repository import PreprocessSpec
from serve_app.errors import InvalidImage
from serve_app.preprocessing import DecodeLimits, decode


@dataclass(frozen=True)
class Crops:
    """One request's JPEGs, decoded: the good ones' crops and the others' errors."""

    pixels: torch.Tensor  # uint8 (len(good), S, S, 3) on the decoder's device, complete
    good: tuple[int, ...]  # position of each row of `pixels` among the request's JPEGs
    errors: tuple[tuple[int, InvalidImage], ...] = ()  # (position, error) of the others

    @staticmethod
    def concat(pieces: list[Crops]) -> Crops:
        """Consecutive pieces of one request's JPEGs as one."""
        if len(pieces) == 1:
            return pieces[0]
        good, errors, offset = [], [], 0
        for piece in pieces:
            good += [offset + i for i in piece.good]
            errors += [(offset + i, error) for i, error in piece.errors]
            offset += len(piece.good) + len(piece.errors)
        return Crops(torch.cat([piece.pixels for piece in pieces]), tuple(good), tuple(errors))


class GpuJpegDecoder:
    def __init__(self, spec: PreprocessSpec, limits: DecodeLimits, device: str = "cuda") -> None:
        from torchvision.io import ImageReadMode, decode_jpeg  # GPU machines only

        self._decode_jpeg, self._mode = decode_jpeg, ImageReadMode.RGB
        self._spec, self._limits, self._device = spec, limits, torch.device(device)
        self._threads = threading.local()

    def crops(self, jpegs: list[bytes]) -> Crops:
        return self.crops_many([jpegs])[0]

    def crops_many(self, requests: list[list[bytes]]) -> list[Crops]:
        """Several requests' JPEGs in one batched decode and one batched resize + crop.
        The crops stay on the GPU (the engine takes them there) and are complete when this
        returns, so any thread or stream may read them."""
        with torch.cuda.stream(self._thread_stream()):
            crops = self._crops_many(requests)
            if self._device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        return crops

    def _crops_many(self, requests: list[list[bytes]]) -> list[Crops]:
        """A bad JPEG fails the whole batched call: then each request is decoded on its own,
        and only the one holding the bad JPEG goes image by image."""
        try:
            images = self.decode_batch([jpeg for jpegs in requests for jpeg in jpegs])
        except RuntimeError:
            if len(requests) == 1:
                return [self._one_by_one(requests[0])]
            return [self._crops_many([jpegs])[0] for jpegs in requests]
        crops = crop_batch(images, self._spec)
        bounds = itertools.accumulate((len(jpegs) for jpegs in requests), initial=0)
        return [Crops(crops[lo:hi], tuple(range(hi - lo))) for lo, hi in itertools.pairwise(bounds)]

    def decode_batch(self, jpegs: list[bytes]) -> list[torch.Tensor]:
        """One batched nvJPEG call: (3, H, W) uint8 images on the device; a bad JPEG fails
        the whole call (RuntimeError)."""
        data = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
        return self._decode_jpeg(data, mode=self._mode, device=self._device)

    def _one_by_one(self, jpegs: list[bytes]) -> Crops:
        """The CPU path for each JPEG of a request nvJPEG refused, for its diagnosis."""
        good, pixels, errors = [], [], []
        for position, jpeg in enumerate(jpegs):
            try:
                pixels.append(decode(jpeg, self._spec, self._limits))
                good.append(position)
            except InvalidImage as exc:
                errors.append((position, exc))
        size = self._spec.input_size
        stacked = np.stack(pixels) if pixels else np.empty((0, size, size, 3), np.uint8)
        return Crops(torch.from_numpy(stacked).to(self._device), tuple(good), tuple(errors))

    def _thread_stream(self) -> torch.cuda.Stream | None:
        """A CUDA stream per decoding thread: one thread's resize need not queue behind
        another's decode. None (no stream) off the GPU."""
        if self._device.type != "cuda":
            return None
        if not hasattr(self._threads, "stream"):
            self._threads.stream = torch.cuda.Stream(self._device)
        return self._threads.stream


def with_host_crops(host: np.ndarray, crops: torch.Tensor) -> torch.Tensor:
    """A request's CPU-decoded crops (PNGs, rotated JPEGs: `host`) ahead of its GPU crops, on
    the GPU. Uploaded from pinned memory on the caller's stream, which GPU engines wait for,
    so the caller does not block."""
    uploaded = torch.from_numpy(host).pin_memory().to(crops.device, non_blocking=True)
    return torch.cat([uploaded, crops])


def crop_batch(images: list[torch.Tensor], spec: PreprocessSpec) -> torch.Tensor:
    """(3, H, W) uint8 images of any sizes -> (N, S, S, 3) uint8 crops (the engine's layout):
    shorter side to resize_size, center crop S, in the same dozen or so kernel launches for
    any mix of sizes.

    Antialiased bilinear resizing is separable: each output row is a weighted sum of a few
    input rows, with the weights of a triangle filter widened by the shrink factor (PIL's,
    and torch's `antialias=True`), and the same for columns. So an image's resize and crop
    is `Wy @ image @ Wx.T`, where Wy (S, h) and Wx (S, w) hold the weights of the cropped rows
    and columns over the window of h x w input pixels they read. The windows are copied
    into one padded batch and both products run batched; the weights are made on the device
    from each image's filter centres (zero past its window), so nothing large is uploaded.

    Grouping by size and calling `F.interpolate` per size (the code before this) cost ~8
    launches and a stream synchronization per distinct size (bench/gpu_pipeline.py).
    """
    device = images[0].device
    n, size = len(images), spec.input_size
    axes = [_crop_axes(image.shape[1], image.shape[2], spec) for image in images]
    rows_k = max(rows.length for rows, _ in axes)
    cols_k = max(cols.length for _, cols in axes)
    windows = torch.empty((n, 3, rows_k, cols_k), dtype=torch.uint8, device=device)
    for window, image, (rows, cols) in zip(windows, images, axes, strict=True):
        window[:, : rows.length, : cols.length].copy_(
            image[:, rows.start : rows.start + rows.length, cols.start : cols.start + cols.length]
        )
    # One upload: per axis and image, the crop's filter centres, the filter scale, the window
    # length. fp16 products on the GPU (pixels are exact in fp16; ~0.1 grey level of error).
    params = np.array(
        [[[*a.centers, a.scale, a.length] for a in axis] for axis in zip(*axes, strict=True)],
        dtype=np.float32,
    )
    params = torch.from_numpy(params)
    if device.type == "cuda":
        params = params.pin_memory().to(device, non_blocking=True)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    centers, scale, length = (
        params[..., :size, None],
        params[..., size, None, None],
        params[..., size + 1, None, None],
    )
    k = torch.arange(max(rows_k, cols_k), device=device, dtype=torch.float32)
    weights = (1.0 - ((k + 0.5 - centers) / scale).abs()).clamp_(min=0.0) * (k < length)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)  # (2, n, S, K)
    rows_w, cols_w = weights[0, :, None, :, :rows_k], weights[1, :, None, :, :cols_k]
    crops = rows_w @ windows.to(dtype) @ cols_w.transpose(-1, -2)  # (n, 3, S, S)
    out = torch.empty((n, size, size, 3), dtype=torch.uint8, device=device)
    return out.copy_(crops.round_().clamp_(0, 255).permute(0, 2, 3, 1))


@dataclass(frozen=True)
class _Axis:
    start: int  # first input pixel the crop reads
    length: int  # input pixels read
    centers: np.ndarray  # (S,) filter centre of each output pixel, from `start`
    scale: float  # the filter's width: the shrink factor, at least 1


def _crop_axes(height: int, width: int, spec: PreprocessSpec) -> tuple[_Axis, _Axis]:
    """Rows and columns of the shorter-side resize + center crop, as torch's antialiased
    `interpolate` and PIL compute them (a filter of support `scale` around each centre)."""
    shrink = spec.resize_size / min(width, height)
    axes = []
    for in_size in (height, width):
        out_size = max(spec.input_size, round(in_size * shrink))
        offset = (out_size - spec.input_size) // 2
        step = in_size / out_size
        scale = max(step, 1.0)
        centers = (offset + np.arange(spec.input_size) + 0.5) * step
        start = max(int(centers[0] - scale + 0.5), 0)
        stop = min(int(centers[-1] + scale + 0.5), in_size)
        axes.append(_Axis(start, stop - start, centers - start, scale))
    return axes[0], axes[1]
