"""JPEG decode, resize and center-crop on the GPU (batched nvJPEG through torchvision).

PIL on 16 cores caps near 7,000 small photos/s while batched nvJPEG decodes 35,000/s on
the same H200 host. With `decode: gpu`, the preprocess stage only reads JPEG headers
(engines/jpeg.py); the JPEGs nvJPEG can take travel as bytes to the inference replica (or,
with `experimental.preprocess_decodes_on_gpu`, stay in the Preprocess replica), which decodes
them here.
Anything nvJPEG rejects is decoded again on the CPU, so its error message
is the CPU path's.

Resizing uses bilinear interpolation with antialiasing, as PIL does; results match the CPU
path to within a few grey levels, not bit for bit (tests/gpu/test_nvjpeg.py).
"""

from __future__ import annotations

import io
import itertools
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from engines import crop_kernel
from engines.cuda_graphs import wait_asleep
from engines.images import DecodeLimits, InvalidImage, decode
from engines.repository import PreprocessSpec


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


# (3, H, W) uint8 images on the device, one per JPEG; a bad JPEG fails the whole call with
# RuntimeError, as torchvision's nvJPEG does
BatchDecode = Callable[[list[bytes]], list[torch.Tensor]]


class GpuJpegDecoder:
    def __init__(
        self,
        spec: PreprocessSpec,
        limits: DecodeLimits,
        device: str = "cuda",
        decode_batch: BatchDecode | None = None,
        chunk: int | None = None,
        hybrid_decode: BatchDecode | None = None,
        hybrid_min_jpegs: int = 0,
        hybrid_share: float = 1.0,
    ) -> None:
        """decode_batch: torchvision's batched nvJPEG when None (tests pass others).
        hybrid_decode: takes `hybrid_share` of the calls of at least hybrid_min_jpegs JPEGs
        instead (nvJPEG's GPU_HYBRID backend, engines/nvjpeg.py), spread evenly among them.
        Whole calls, not a part of each as DALI's hw_decoder_load splits them: GPU_HYBRID
        decodes the Huffman codes of smaller calls on the CPU.
        chunk: the most JPEGs it is given at once (None: a call's all). Twelve processes
        decoding alone spent less CPU in chunks of 8 than in calls of 64 (0.18 ms an image
        against 0.73), but the served config, its GPU busy with the engines too, served less
        at more CPU with them (docs/performance.md, row 6): None in the server
        (bench/decode_procs.py --chunk measures others)."""
        self._spec, self._limits, self._device = spec, limits, torch.device(device)
        self._chunk = chunk
        self.decode_batch = decode_batch or self._torchvision_decoder()
        self._hybrid, self._hybrid_min_jpegs = hybrid_decode, hybrid_min_jpegs
        share = Fraction(hybrid_share if hybrid_decode is not None else 0).limit_denominator(1000)
        self._hybrid_share = share
        # full calls so far, from a random place in the pattern: replicas out of phase
        self._full_calls = random.randrange(share.denominator)
        self._threads = threading.local()

    def _torchvision_decoder(self) -> BatchDecode:
        from torchvision.io import ImageReadMode, decode_jpeg  # GPU machines only

        def decode_batch(jpegs: list[bytes]) -> list[torch.Tensor]:
            data = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self._device)

        return decode_batch

    def crops(self, jpegs: list[bytes]) -> Crops:
        return self.crops_many([jpegs])[0]

    def warmup(self) -> Crops:
        """Decode and crop generated JPEGs once on this thread (its CUDA stream, nvJPEG's
        first call, the resize kernels' lazy loading; the GPU_HYBRID backend's too), so no
        request pays for it: on an H200 the first request after ready took 4 s, all of it
        in decode."""
        jpegs = [_sample_jpeg(640, 480), _sample_jpeg(480, 640)]
        hybrid = None
        if self._hybrid is not None:
            full = jpegs * -(-max(self._hybrid_min_jpegs, 1) // 2)
            with torch.cuda.stream(self._thread_stream()):
                # a full call, whichever decoder the share gives it; its images are kept
                # until the crops below are done on the same stream: their memory is not
                # handed to another decode while its kernels may still write it
                hybrid = self._hybrid(full)
        crops = self.crops(jpegs)
        del hybrid
        return crops

    def crops_many(self, requests: list[list[bytes]]) -> list[Crops]:
        """Several requests' JPEGs in one batched decode, then resized and cropped together
        (one call per distinct image size). The crops stay on the GPU (the engine takes them
        there) and are complete when this returns, so any thread or stream may read them."""
        with torch.cuda.stream(self._thread_stream()):
            crops = self._crops_many(requests)
            if self._device.type == "cuda":
                wait_asleep(torch.cuda.current_stream())
        return crops

    def _crops_many(self, requests: list[list[bytes]]) -> list[Crops]:
        """A bad JPEG fails the whole batched call: then each request is decoded on its own,
        and only the one holding the bad JPEG goes image by image."""
        try:
            images = self.decode_in_chunks([jpeg for jpegs in requests for jpeg in jpegs])
        except RuntimeError:
            if len(requests) == 1:
                return [self._one_by_one(requests[0])]
            return [self._crops_many([jpegs])[0] for jpegs in requests]
        crops = crop_batch(images, self._spec)
        bounds = itertools.accumulate((len(jpegs) for jpegs in requests), initial=0)
        return [Crops(crops[lo:hi], tuple(range(hi - lo))) for lo, hi in itertools.pairwise(bounds)]

    def decode_in_chunks(self, jpegs: list[bytes]) -> list[torch.Tensor]:
        """decode_batch (or hybrid_decode) in calls of at most `chunk` JPEGs."""
        step = self._chunk or max(len(jpegs), 1)
        images = []
        for i in range(0, len(jpegs), step):
            chunk = jpegs[i : i + step]
            hybrid = len(chunk) >= self._hybrid_min_jpegs and self._hybrid_turn()
            images += (self._hybrid if hybrid else self.decode_batch)(chunk)
        return images

    def _hybrid_turn(self) -> bool:
        """Whether this full call goes to the hybrid decoder: hybrid_share of them do, spread
        evenly (exact fractions: a share of 1/3 is one call in three, for ever)."""
        share, before = self._hybrid_share, self._full_calls
        self._full_calls += 1
        return math.floor(self._full_calls * share) > math.floor(before * share)

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


def _sample_jpeg(width: int, height: int) -> bytes:
    """A real JPEG of a colour gradient, made here (no file to ship)."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    pixels = (x + y + np.array([0.0, 60.0, 120.0])) % 256  # (height, width, 3)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def crop_batch(images: list[torch.Tensor], spec: PreprocessSpec) -> torch.Tensor:
    """(3, H, W) uint8 images -> (N, S, S, 3) uint8 crops (the engine's layout): shorter side
    to resize_size, center crop S. On a GPU with Triton, in one kernel launch
    (engines/crop_kernel.py); elsewhere with torch's antialiased interpolation."""
    sizes = [resized_size(image.shape[1], image.shape[2], spec) for image in images]
    if images[0].is_cuda and crop_kernel.available(spec.input_size):
        return crop_kernel.resize_crop(
            [image.contiguous() for image in images], sizes, spec.input_size
        )
    return interpolate_and_crop(images, sizes, spec.input_size)


def resized_size(height: int, width: int, spec: PreprocessSpec) -> tuple[int, int]:
    """(height, width) with the shorter side at resize_size, neither under the crop."""
    scale = spec.resize_size / min(width, height)
    return max(spec.input_size, round(height * scale)), max(spec.input_size, round(width * scale))


def interpolate_and_crop(
    images: list[torch.Tensor], sizes: list[tuple[int, int]], size: int
) -> torch.Tensor:
    """crop_batch with torch's operators (the reference for the kernel's pixels), in PIL's
    two passes: the width first, rounded to bytes, then the height, rounded again, halves
    up. One rounding over both axes instead puts a tenth of the values a grey level off
    PIL's, darker on average, which moves the embedding to cosine 0.998 of the reference's.
    (Pillow 13 takes the height first for some shapes, portraits taller than 2:1 among them:
    there a tenth of the values are a grey level off either way, cosine 0.9995 or more.)
    Images of the same size resize in one call (catalog photos often share a size) and land
    in their rows with one scatter, so the kernel launches grow with the number of distinct
    sizes, not of images. The rows' indices go up from pinned memory: from pageable memory
    the copy would wait for the stream."""
    groups: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        groups.setdefault(tuple(image.shape[1:]), []).append(index)
    out = None
    if len(groups) > 1:
        out = torch.empty((len(images), size, size, 3), dtype=torch.uint8, device=images[0].device)
    for indices in groups.values():
        new_h, new_w = sizes[indices[0]]
        same = (
            torch.stack([images[i] for i in indices])
            if len(indices) > 1
            else images[indices[0]][None]
        )
        top, left = (new_h - size) // 2, (new_w - size) // 2
        rows = _resample(same.float(), (same.shape[2], new_w))[..., left : left + size]
        crops = _resample(rows, (new_h, size))[:, :, top : top + size]
        rows = crops.permute(0, 2, 3, 1).to(torch.uint8)
        if len(groups) == 1:
            return rows.contiguous()
        out.index_copy_(0, _on(torch.tensor(indices), out.device), rows)
    return out


def _resample(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """One of PIL's passes: antialiased bilinear to `size` (one axis changes), rounded to
    whole grey levels halves up and clamped, as its fixed-point sums are."""
    resized = F.interpolate(images, size=size, mode="bilinear", antialias=True, align_corners=False)
    return resized.add_(0.5).floor_().clamp_(0, 255)


def _on(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return indices
    return indices.pin_memory().to(device, non_blocking=True)
