"""nvJPEG's batched decode with its GPU_HYBRID backend: Huffman decoding in CUDA kernels.

torchvision's batched decode uses the GPU's JPEG hardware decoder, whose calling thread
polls for the hardware the whole call (docs/performance.md, CPU per image): twelve
processes decoding at once spent 0.76 ms of CPU an image. With GPU_HYBRID the same call
queues kernels and sleeps until they are done (with blocking-sync waits): on one H100,
0.07 ms an image at 94% of the hardware's images/s in calls of 64, but calls of 8-32 JPEGs
were Huffman-decoded on the CPU (1.4 ms an image), and its kernels take SM time the engine
needs (docs/performance.md). GpuJpegDecoder gives it a share of the full calls
(`experimental.gpu_hybrid_decode`), the hardware decoder the rest.

The library is the one torchvision loaded, called through ctypes: each decoding thread has
its own decode state, initialized again only when its batch size changes.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

BACKEND_GPU_HYBRID, OUTPUT_RGB = 2, 3  # nvJPEG's enum values


class _Image(ctypes.Structure):  # nvjpegImage_t: planar output, one pointer per channel
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


class NvjpegError(RuntimeError):
    """An nvJPEG call failed (a RuntimeError, as torchvision's decode raises)."""


def _check(name: str, status: int) -> None:
    if status != 0:
        raise NvjpegError(f"{name} failed with nvJPEG status {status}")


def _loaded_nvjpeg() -> ctypes.CDLL:
    """The libnvjpeg that torchvision's image extension loaded into this process."""
    from torchvision.io import decode_jpeg  # noqa: F401  (loads torchvision's image.so)

    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libnvjpeg" in Path(path).name:
            return ctypes.CDLL(path)
    return ctypes.CDLL("libnvjpeg.so")


class HybridJpegDecoder:
    """A BatchDecode (engines/gpu_decode.py): (3, H, W) uint8 RGB tensors on `device`,
    queued on the current CUDA stream (complete once that stream's work is). Any nvJPEG
    failure raises NvjpegError for the whole call."""

    def __init__(self, device: str = "cuda") -> None:
        self._device = torch.device(device)
        self._lib = _loaded_nvjpeg()
        self._handle = ctypes.c_void_p()
        status = self._lib.nvjpegCreateEx(
            BACKEND_GPU_HYBRID, None, None, 0, ctypes.byref(self._handle)
        )
        _check("nvjpegCreateEx", status)
        self._threads = threading.local()

    def _state(self):
        """This thread's decode state and the batch size it was initialized for."""
        threads = self._threads
        if not hasattr(threads, "state"):
            threads.state, threads.batch = ctypes.c_void_p(), 0
            status = self._lib.nvjpegJpegStateCreate(self._handle, ctypes.byref(threads.state))
            _check("nvjpegJpegStateCreate", status)
        return threads

    def __call__(self, jpegs: list[bytes]) -> list[torch.Tensor]:
        lib, handle, threads, n = self._lib, self._handle, self._state(), len(jpegs)
        # nvJPEG reads bytes objects in place; other buffers (shared memory views) copied
        jpegs = [jpeg if isinstance(jpeg, bytes) else bytes(jpeg) for jpeg in jpegs]
        components, subsampling = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
        images, outputs = [], (_Image * n)()
        for jpeg, output in zip(jpegs, outputs, strict=True):
            status = lib.nvjpegGetImageInfo(
                handle, jpeg, ctypes.c_size_t(len(jpeg)), ctypes.byref(components),
                ctypes.byref(subsampling), widths, heights,
            )  # fmt: skip
            _check("nvjpegGetImageInfo", status)
            image = torch.empty((3, heights[0], widths[0]), dtype=torch.uint8, device=self._device)
            for c in range(3):
                output.channel[c] = image[c].data_ptr()
                output.pitch[c] = widths[0]
            images.append(image)
        if threads.batch != n:
            threads.batch = 0  # initialized again after a failure too, as nvJPEG asks
            status = lib.nvjpegDecodeBatchedInitialize(handle, threads.state, n, 1, OUTPUT_RGB)
            _check("nvjpegDecodeBatchedInitialize", status)
            threads.batch = n
        stream = ctypes.c_void_p(torch.cuda.current_stream(self._device).cuda_stream)
        data = (ctypes.c_char_p * n)(*jpegs)
        lengths = (ctypes.c_size_t * n)(*map(len, jpegs))
        status = lib.nvjpegDecodeBatched(handle, threads.state, data, lengths, outputs, stream)
        if status != 0:
            threads.batch = 0
            _check("nvjpegDecodeBatched", status)
        return images
