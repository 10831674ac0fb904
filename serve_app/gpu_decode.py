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

import numpy as np
import torch
import torch.nn.functional as F

from engines.repository import PreprocessSpec
from serve_app.errors import InvalidImage
from serve_app.preprocessing import DecodeLimits, decode


class GpuJpegDecoder:
    def __init__(self, spec: PreprocessSpec, limits: DecodeLimits, device: str = "cuda") -> None:
        from torchvision.io import ImageReadMode, decode_jpeg  # GPU machines only

        self._decode_jpeg, self._mode = decode_jpeg, ImageReadMode.RGB
        self._spec, self._limits, self._device = spec, limits, torch.device(device)

    def crops(self, jpegs: list[bytes]) -> list[np.ndarray | InvalidImage]:
        """uint8 (H, W, 3) crops in host memory, or the InvalidImage for each JPEG."""
        return self.crops_many([jpegs])[0]

    def crops_many(self, requests: list[list[bytes]]) -> list[list[np.ndarray | InvalidImage]]:
        """Several requests' JPEGs in one batched decode (one resize per distinct size).
        A bad JPEG fails the whole batched call: then each request is decoded on its own,
        and only the one holding the bad JPEG goes image by image."""
        try:
            images = self.decode_batch([jpeg for jpegs in requests for jpeg in jpegs])
        except RuntimeError:
            if len(requests) == 1:
                return [[self._one(jpeg) for jpeg in requests[0]]]
            return [self.crops_many([jpegs])[0] for jpegs in requests]
        crops = crop_batch(images, self._spec).permute(0, 2, 3, 1).contiguous().cpu().numpy()
        bounds = itertools.accumulate((len(jpegs) for jpegs in requests), initial=0)
        return [list(crops[lo:hi]) for lo, hi in itertools.pairwise(bounds)]

    def decode_batch(self, jpegs: list[bytes]) -> list[torch.Tensor]:
        """One batched nvJPEG call: (3, H, W) uint8 images on the device; a bad JPEG fails
        the whole call (RuntimeError)."""
        data = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
        return self._decode_jpeg(data, mode=self._mode, device=self._device)

    def _one(self, jpeg: bytes) -> np.ndarray | InvalidImage:
        try:
            return decode(jpeg, self._spec, self._limits)  # the CPU path, for its diagnosis
        except InvalidImage as exc:
            return exc


def crop_batch(images: list[torch.Tensor], spec: PreprocessSpec) -> torch.Tensor:
    """(3, H, W) uint8 images -> (N, 3, S, S) uint8: shorter side to resize_size, center crop.

    Images of the same size resize in one call (catalog photos often share a size), so the
    kernel launches grow with the number of distinct sizes, not of images."""
    size = spec.input_size
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=images[0].device)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        groups.setdefault(tuple(image.shape[1:]), []).append(index)
    for (height, width), indices in groups.items():
        scale = spec.resize_size / min(width, height)
        new_h = max(size, round(height * scale))
        new_w = max(size, round(width * scale))
        resized = F.interpolate(
            torch.stack([images[i] for i in indices]).float(),
            size=(new_h, new_w),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        top, left = (new_h - size) // 2, (new_w - size) // 2
        crop = resized[:, :, top : top + size, left : left + size]
        out[indices] = crop.round_().clamp_(0, 255).to(torch.uint8)
    return out
