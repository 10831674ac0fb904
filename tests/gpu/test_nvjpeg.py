"""decode: gpu on a GPU: nvJPEG's crops match the CPU path's, and a replica with the real
decoder and the torch-CUDA engine answers each image of mixed requests."""

from __future__ import annotations

import importlib.util
import io

import numpy as np
import pytest
import torch
from PIL import Image
from support import batch_of, top_classes

from serve_app.config import STAGES, AppConfig
from serve_app.pipeline.topology import StageGroup

from conftest import encode

CATS = range(281, 286)
COFFEE = {967, 968, 504}
HAS_GPU_DECODE = importlib.util.find_spec("torchvision") is not None and torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU_DECODE, reason="needs a CUDA GPU and torchvision (nvJPEG)"),
]


def test_nvjpeg_crops_match_the_cpu_path(model, photos) -> None:
    from engines.gpu_decode import GpuJpegDecoder
    from engines.images import DecodeLimits, InvalidImage, decode

    spec = model.spec.preprocess
    decoder = GpuJpegDecoder(spec, DecodeLimits())
    gray = encode(np.asarray(Image.open(io.BytesIO(photos["coffee"])).convert("L")), "JPEG")
    jpegs = [photos[n] for n in ("chelsea", "coffee", "astronaut", "rocket")] + [gray]
    crops = decoder.crops(jpegs)
    assert crops.pixels.is_cuda and crops.pixels.shape == (5, 224, 224, 3)
    assert crops.good == (0, 1, 2, 3, 4) and crops.errors == ()
    for jpeg, crop in zip(jpegs, crops.pixels.cpu().numpy(), strict=True):
        reference = decode(jpeg, spec).astype(np.int16)
        assert np.abs(crop.astype(np.int16) - reference).mean() < 3.0
    # A JPEG nvJPEG rejects fails alone, with the CPU path's message.
    junk = b"\xff\xd8\xff\xdb" + b"\x00" * 64 + b"\xff\xd9"
    crops = decoder.crops([jpegs[0], junk])
    assert crops.good == (0,) and crops.pixels.is_cuda and len(crops.pixels) == 1
    with pytest.raises(InvalidImage) as cpu_error:
        decode(junk, spec)
    assert [(i, str(e)) for i, e in crops.errors] == [(1, str(cpu_error.value))]
    both = decoder.crops_many([jpegs[:1], jpegs[1:]])
    assert [len(c.pixels) for c in both] == [1, 4]


SIZES = [(300, 451), (100, 60), (128, 128), (224, 224), (256, 256), (512, 512), (257, 900),
         (1200, 300), (2600, 3000)]  # fmt: skip


def test_the_crop_kernel_gives_torchs_pixels() -> None:
    """engines/crop_kernel.py against torch's antialiased interpolation (its reference, and
    the path without Triton), in one call: images smaller than the crop (upscaled, 128x128
    at exactly 2x, where sums land on exact halves), of the crop's size, of the resize's,
    twice it, wide, tall, and one whose window is four times wider (a launch of its own),
    each landing in its own row."""
    from engines import crop_kernel
    from engines.gpu_decode import interpolate_and_crop, resized_size
    from engines.repository import PreprocessSpec

    assert crop_kernel.available(224)
    spec = PreprocessSpec()
    generator = torch.Generator(device="cuda").manual_seed(0)
    images = []
    for height, width in SIZES:
        coarse = torch.rand(
            (1, 3, height // 8 + 1, width // 8 + 1), generator=generator, device="cuda"
        )
        smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear")
        noise = torch.randint(0, 24, (3, height, width), generator=generator, device="cuda")
        images.append((smooth[0] * 230 + noise).clamp(0, 255).to(torch.uint8))
    sizes = [resized_size(image.shape[1], image.shape[2], spec) for image in images]
    fused = crop_kernel.resize_crop(images, sizes, spec.input_size)
    reference = interpolate_and_crop(images, sizes, spec.input_size)
    assert fused.shape == reference.shape == (len(SIZES), 224, 224, 3)
    difference = (fused.int() - reference.int()).abs()
    assert difference.max().item() <= 1  # float sums taken in another order
    assert (difference > 0).float().mean().item() < 1e-3
    with pytest.raises(ValueError):
        crop_kernel.resize_crop(images[:1], [(200, 300)], spec.input_size)


def test_gpu_hybrid_decode_matches_the_hardware_decoder(photos) -> None:
    """nvJPEG's GPU_HYBRID backend, called directly, gives the pixels torchvision's hardware
    decode gives, for a call of 64 (colour, grayscale and progressive JPEGs, odd sizes), and
    a call holding an undecodable JPEG raises RuntimeError as torchvision's does."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from engines.nvjpeg import HybridJpegDecoder

    coffee = np.asarray(Image.open(io.BytesIO(photos["coffee"])))
    made = [
        encode(coffee[..., 0], "JPEG"),  # grayscale
        encode(coffee, "JPEG", progressive=True),
        encode(coffee[:301, :199], "JPEG"),  # odd sizes
    ]
    builtin = [photos[n] for n in ("chelsea", "coffee", "astronaut", "rocket")]
    jpegs = (made + builtin * 16)[:64]
    decoder = HybridJpegDecoder()
    ours = decoder(jpegs)
    data = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
    theirs = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
    torch.cuda.synchronize()
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.shape == reference.shape
        assert (mine.int() - reference.int()).abs().float().mean() < 2.0
    with pytest.raises(RuntimeError):
        decoder([*jpegs[:63], b"\xff\xd8\xff\xdb" + b"\x00" * 64 + b"\xff\xd9"])
        torch.cuda.synchronize()
    assert len(decoder(jpegs)) == 64  # the thread's state usable again after a failure


async def test_gpu_replica_keeps_crops_on_the_gpu_and_answers_each_image(
    model_repository, photos
) -> None:
    """The real decoder and torch-CUDA engine in one replica: requests that mix GPU-decoded
    JPEGs with CPU-decoded images and junk, one split in decode pieces, each get their own
    labels in their own order."""
    from serve_app.config import BatchingConfig, EngineConfig

    config = AppConfig(
        model_repository=model_repository,
        decode="gpu",
        engine=EngineConfig(kind="torch-cuda", batch_capacity=64),
    )
    group = await StageGroup.create(config, STAGES)
    group.reconfigure(BatchingConfig(max_batch_size=64).model_dump())
    png = encode(np.asarray(Image.open(io.BytesIO(photos["coffee"]))), "PNG")
    answers = await group.run(
        batch_of(
            [photos["chelsea"], photos["coffee"]],  # all on the GPU
            [png, photos["chelsea"], b"junk"],  # CPU crops beside GPU ones, and a failure
            [photos["chelsea"], photos["coffee"]] * 20,  # two decode pieces (32 + 10)
        )
    )
    top = top_classes(answers)
    assert top[0][0] in CATS and top[0][1] in COFFEE
    assert top[1][0] in COFFEE and top[1][1] in CATS and top[1][2] == 3
    assert all(t in CATS for t in top[2][::2]) and all(t in COFFEE for t in top[2][1::2])
    assert group.images_inferred() == 2 + 2 + 40


def _crops_checksum(payload: bytes) -> tuple[int, str]:
    """In another process: the crops a stage call carried, summed on this process' GPU."""
    from serve_app.transport import codec

    crops = codec.loads(payload).crops
    return int(crops.sum()), str(crops.device)


def test_crops_reach_another_process_by_cuda_ipc() -> None:
    """A stage call's crops on the GPU travel as the fields of a CUDA IPC handle (a few
    hundred bytes, not their pixels; serve_app/transport/codec.py) and read the same in
    another process on that GPU."""
    import multiprocessing

    from serve_app.core.messages import Batch
    from serve_app.transport import codec

    generator = torch.Generator(device="cuda").manual_seed(0)
    crops = torch.randint(
        0, 256, (32, 224, 224, 3), dtype=torch.uint8, device="cuda", generator=generator
    )
    payload = b"".join(codec.dumps(Batch(jobs=(), crops=crops)))
    assert len(payload) < 4096 < crops.nbytes
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        total, device = pool.apply(_crops_checksum, (payload,))
    assert total == int(crops.sum()) and device.startswith("cuda")
