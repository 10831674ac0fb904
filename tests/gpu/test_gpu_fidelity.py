"""nvJPEG's decode paths against the model's reference preprocessing on the fidelity set
(tests/fidelity.py): the hardware decoder through torchvision and the GPU_HYBRID backend, each
with the one-launch crop kernel (or torch's resize where Triton is missing) and with torch's
resize. The JPEGs the served path does not give nvJPEG (EXIF-rotated, or smaller than the
resize size: engines/jpeg.py's nvjpeg_size) go to the CPU path, which tests/unit/test_fidelity.py
checks."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fidelity import Fidelity, Reference, fidelity_set

HAS_GPU_DECODE = importlib.util.find_spec("torchvision") is not None and torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU_DECODE, reason="needs a CUDA GPU and torchvision (nvJPEG)"),
]


def test_nvjpeg_paths_match_the_reference(model) -> None:
    from engines import crop_kernel
    from engines.gpu_decode import (
        GpuJpegDecoder,
        crop_batch,
        interpolate_and_crop,
        resized_size,
    )
    from engines.images import DecodeLimits
    from engines.jpeg import nvjpeg_size
    from engines.nvjpeg import HybridJpegDecoder

    spec = model.spec.preprocess
    reference = Reference(model, fidelity_set())
    # the JPEGs the served path gives nvJPEG (smaller ones than the resize size go to the CPU)
    chosen = [i for i, s in enumerate(reference.samples) if nvjpeg_size(s.data, spec.resize_size)]
    jpegs = [reference.samples[i].data for i in chosen]
    resize = "crop kernel" if crop_kernel.available(spec.input_size) else "torch resize"
    decoder = GpuJpegDecoder(spec, DecodeLimits())

    # The served call: every JPEG decoded by nvJPEG, none left to the CPU.
    crops = decoder.crops(jpegs)
    assert crops.good == tuple(range(len(jpegs))) and crops.errors == ()
    results: list[Fidelity] = [
        reference.compare(f"nvJPEG + {resize}", crops.pixels.cpu().numpy(), chosen)
    ]
    for name, decode in (("nvJPEG", decoder.decode_batch), ("GPU_HYBRID", HybridJpegDecoder())):
        images = decode(jpegs)  # raises if nvJPEG refuses any of them
        sizes = [resized_size(image.shape[1], image.shape[2], spec) for image in images]
        torch_crops = interpolate_and_crop(images, sizes, spec.input_size)
        results.append(
            reference.compare(f"{name} + torch resize", torch_crops.cpu().numpy(), chosen)
        )
        if name == "GPU_HYBRID":
            hybrid_crops = crop_batch(images, spec)
            results.append(
                reference.compare(f"{name} + {resize}", hybrid_crops.cpu().numpy(), chosen)
            )
    failures = [line for result in results for line in result.failures()]
    assert not failures, "\n".join(failures)
