"""decode: gpu on the CPU: header checks and routing, the GPU path's resize and crop on CPU
tensors, and the decoder's batching with a stand-in for nvJPEG (nvJPEG itself:
tests/gpu/test_nvjpeg.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from support import batch_of, top_classes, until

from serve_app import tuning
from serve_app.config import STAGES, AppConfig
from serve_app.pipeline.topology import StageGroup
from serve_app.stages.preprocess import PreprocessStage

from conftest import encode

CATS = range(281, 286)
COFFEE = {967, 968, 504}


def _preprocessor(model_repository, decode: str) -> PreprocessStage:
    config = AppConfig(model_repository=model_repository, decode=decode)
    return PreprocessStage(config, StageGroup.model_spec(config).preprocess)


async def test_gpu_mode_passes_plain_jpegs_on_encoded(model_repository, photos) -> None:
    png = encode(np.asarray(Image.open(io.BytesIO(photos["coffee"]))), "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = encode(
        np.asarray(Image.open(io.BytesIO(photos["coffee"]))), "JPEG", exif=exif.tobytes()
    )
    truncated = photos["chelsea"][: len(photos["chelsea"]) // 3]
    images = [photos["chelsea"], png, b"junk", rotated, photos["coffee"], truncated]
    pre = await _preprocessor(model_repository, "gpu").run(batch_of(images))
    assert pre.jpeg_owners[:, 1].tolist() == [0, 4]
    assert pre.jpegs == (photos["chelsea"], photos["coffee"])
    assert pre.crop_owners[:, 1].tolist() == [1, 3]  # PNG, EXIF-rotated JPEG: on the CPU
    # Truncated JPEGs stay on the CPU path, which reports them (nvJPEG does not).
    assert sorted(image for _, image in pre.image_failures) == [2, 5]
    assert "truncated" in pre.image_failures[0, 5].message
    cpu = await _preprocessor(model_repository, "cpu").run(batch_of(images))
    assert cpu.jpegs == () and cpu.crop_owners[:, 1].tolist() == [0, 1, 3, 4]


def test_crops_of_mixed_sizes_in_one_batch_equal_one_at_a_time(model, photos) -> None:
    """The GPU path's resize + crop, run here on CPU tensors: a batch of mixed sizes (same
    sizes resized together) gives each image's crop as alone, and the crops match the CPU
    path's, for shrinking, enlarging (a photo smaller than the crop) and tall images."""
    from engines.gpu_decode import crop_batch
    from engines.images import decode

    rng = np.random.default_rng(0)
    small = encode(rng.integers(0, 256, (100, 150, 3), dtype=np.uint8), "PNG")
    tall = encode(np.asarray(Image.open(io.BytesIO(photos["coffee"])))[:, :200], "PNG")
    encoded = [photos[n] for n in ("chelsea", "coffee", "chelsea", "astronaut")] + [small, tall]
    images = [
        torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
        .permute(2, 0, 1)
        .contiguous()
        for data in encoded
    ]
    # Without crop padding the filters reach the image's edges, past which nothing counts.
    for spec in (
        model.spec.preprocess,
        dataclasses.replace(model.spec.preprocess, resize_size=224),
    ):
        batched = crop_batch(images, spec)
        assert batched.shape == (6, 224, 224, 3) and batched.dtype == torch.uint8
        for image, crop, data in zip(images, batched, encoded, strict=True):
            assert torch.equal(crop_batch([image], spec)[0], crop)
            difference = np.abs(crop.numpy().astype(np.int16) - decode(data, spec))
            assert difference.mean() < 3.0 and difference[[0, -1]].mean() < 3.0  # edge rows


def test_the_gpu_resize_gives_pils_pixels() -> None:
    """The GPU path's resize and crop (torch's operators, as on a GPU without Triton; the
    crop kernel computes the same) against PIL's bilinear resize, the model's reference: equal
    at exactly 2x and when enlarging; at other scales at most a grey level off on under 2% of
    the values (PIL's weights are fixed-point, these float: a sum on an exact half can round
    apart); a portrait taller than 2:1, which Pillow resizes height first, on under 20%."""
    from fidelity import reference_crop
    from skimage import data

    from engines.gpu_decode import crop_batch
    from engines.repository import PreprocessSpec

    spec = PreprocessSpec()
    grey = data.camera()  # 512x512: exactly 2x the resize size, sums on exact halves
    cases = {
        "astronaut": (data.astronaut(), 0.0),
        "camera": (np.repeat(grey[:, :, None], 3, axis=2), 0.0),
        "enlarged": (np.random.default_rng(0).integers(0, 256, (100, 150, 3), np.uint8), 0.0),
        "chelsea": (data.chelsea(), 0.02),
        "rocket": (data.rocket(), 0.02),
        "tall": (np.asarray(Image.fromarray(data.coffee()).resize((400, 900))), 0.2),
    }
    for name, (pixels, off_at_most) in cases.items():
        pil = reference_crop(encode(pixels, "PNG"), spec.input_size, spec.resize_size)
        image = torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous()
        crop = crop_batch([image], spec)[0].numpy()
        difference = np.abs(crop.astype(np.int16) - pil)
        assert difference.max() <= 1, name
        assert (difference > 0).mean() <= off_at_most, (name, (difference > 0).mean())


class _PilBatchDecoder:
    """Stands in for torchvision's batched nvJPEG on a CPU box: same inputs and outputs, and
    like nvJPEG one bad JPEG fails the whole call with a RuntimeError. Counts the JPEGs of
    each call, and notes the thread that made it; `gate` holds calls back."""

    def __init__(self) -> None:
        self.calls, self.threads = [], []
        self.gate = threading.Event()  # cleared: a call waits for it before it returns
        self.gate.set()

    def __call__(self, jpegs: list[bytes]) -> list[torch.Tensor]:
        self.calls.append(len(jpegs))
        self.gate.wait(30)
        self.threads.append(threading.current_thread().name)
        out = []
        for jpeg in jpegs:
            try:
                image = Image.open(io.BytesIO(jpeg)).convert("RGB")
            except Exception as exc:
                raise RuntimeError(f"decode failed: {exc}") from exc
            out.append(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1))
        return out


@pytest.fixture
def stand_in_nvjpeg(monkeypatch) -> _PilBatchDecoder:
    """Every GpuJpegDecoder a stage makes runs on the CPU with the stand-in for nvJPEG."""
    from engines import gpu_decode

    decoder = _PilBatchDecoder()
    construct = gpu_decode.GpuJpegDecoder.__init__

    def on_the_cpu(self, spec, limits, **_):
        construct(self, spec, limits, device="cpu", decode_batch=decoder)

    monkeypatch.setattr(gpu_decode.GpuJpegDecoder, "__init__", on_the_cpu)
    return decoder


def test_requests_decode_together_and_a_bad_jpeg_fails_alone(model, photos) -> None:
    from engines.gpu_decode import Crops, GpuJpegDecoder
    from engines.images import DecodeLimits, InvalidImage, decode

    spec = model.spec.preprocess
    stand_in = _PilBatchDecoder()
    decoder = GpuJpegDecoder(spec, DecodeLimits(), device="cpu", decode_batch=stand_in)
    first = [photos["chelsea"], photos["coffee"]]
    second = [photos["rocket"], photos["chelsea"], photos["astronaut"]]
    crops = decoder.crops_many([first, second])
    assert stand_in.calls == [5]  # one call for both requests
    assert [c.good for c in crops] == [(0, 1), (0, 1, 2)]
    pixels = torch.cat([c.pixels for c in crops]).numpy()
    for jpeg, crop in zip(first + second, pixels, strict=True):
        reference = decode(jpeg, spec).astype(np.int16)
        assert np.abs(crop.astype(np.int16) - reference).mean() < 3.0
    stand_in.calls.clear()
    bad = [photos["coffee"], b"\xff\xd8\xff\xdb" + b"\x00" * 64 + b"\xff\xd9"]
    crops = decoder.crops_many([first, bad, second])
    assert stand_in.calls == [7, 2, 2, 3]  # all, then each request; the bad one goes one by one
    assert [c.good for c in crops] == [(0, 1), (0,), (0, 1, 2)]
    assert [len(c.pixels) for c in crops] == [2, 1, 3]
    assert [i for i, _ in crops[1].errors] == [1] and not crops[0].errors + crops[2].errors
    with pytest.raises(InvalidImage) as cpu_error:  # the CPU path's diagnosis
        decode(bad[1], spec)
    assert str(crops[1].errors[0][1]) == str(cpu_error.value)
    # A request decoded in pieces is joined back, positions and errors included.
    whole = Crops.concat([crops[0], crops[1], crops[2]])
    assert whole.good == (0, 1, 2, 4, 5, 6) and [i for i, _ in whole.errors] == [3]
    assert torch.equal(whole.pixels[2], crops[1].pixels[0])


def test_a_decoder_decodes_in_chunks_with_the_same_results(model, photos) -> None:
    """nvJPEG is handed at most `chunk` JPEGs a call; the crops, positions and errors are
    those of one call, a bad JPEG in a later chunk included."""
    from engines.gpu_decode import GpuJpegDecoder
    from engines.images import DecodeLimits

    spec = model.spec.preprocess
    whole, chunked = _PilBatchDecoder(), _PilBatchDecoder()
    decoders = [
        GpuJpegDecoder(spec, DecodeLimits(), device="cpu", decode_batch=whole),
        GpuJpegDecoder(spec, DecodeLimits(), device="cpu", decode_batch=chunked, chunk=3),
    ]
    first = [photos["chelsea"], photos["coffee"]]
    bad = [photos["coffee"], b"\xff\xd8\xff\xdb" + b"\x00" * 64 + b"\xff\xd9"]
    second = [photos["rocket"], photos["chelsea"], photos["astronaut"]]
    for requests in ([first, second], [first, bad, second]):
        expected, crops = (decoder.crops_many(requests) for decoder in decoders)
        assert [c.good for c in crops] == [c.good for c in expected]
        assert [[i for i, _ in c.errors] for c in crops] == [
            [i for i, _ in c.errors] for c in expected
        ]
        assert all(torch.equal(c.pixels, e.pixels) for c, e in zip(crops, expected, strict=True))
    assert chunked.calls[:2] == [3, 2] and max(chunked.calls) <= 3


def test_large_calls_go_to_the_hybrid_decoder_with_the_same_results(model, photos) -> None:
    """With a GPU_HYBRID decoder beside the hardware one, calls of at least
    hybrid_min_jpegs JPEGs go to it, smaller ones (and the per-request retries after a bad
    JPEG) to the hardware decoder; the crops, positions and errors are the same."""
    from engines.gpu_decode import GpuJpegDecoder
    from engines.images import DecodeLimits

    spec = model.spec.preprocess
    alone, hardware, hybrid = _PilBatchDecoder(), _PilBatchDecoder(), _PilBatchDecoder()
    plain = GpuJpegDecoder(spec, DecodeLimits(), device="cpu", decode_batch=alone)
    split = GpuJpegDecoder(
        spec,
        DecodeLimits(),
        device="cpu",
        decode_batch=hardware,
        chunk=4,
        hybrid_decode=hybrid,
        hybrid_min_jpegs=4,
    )
    first = [photos["chelsea"], photos["coffee"], photos["rocket"]]
    bad = [photos["coffee"], b"\xff\xd8\xff\xdb" + b"\x00" * 64 + b"\xff\xd9"]
    second = [photos["rocket"], photos["chelsea"], photos["astronaut"]]
    for requests in ([first, second], [first, bad, second], [first]):
        expected, crops = plain.crops_many(requests), split.crops_many(requests)
        assert [c.good for c in crops] == [c.good for c in expected]
        assert [[i for i, _ in c.errors] for c in crops] == [
            [i for i, _ in c.errors] for c in expected
        ]
        assert all(torch.equal(c.pixels, e.pixels) for c, e in zip(crops, expected, strict=True))
    # 6 JPEGs: 4 hybrid + 2; 8: 4 + 4 hybrid, the second holding the bad JPEG, so each
    # request again on its own (3, 2, 3); then 3 JPEGs, fewer than 4
    assert hybrid.calls == [4, 4, 4]
    assert hardware.calls == [2, 3, 2, 3, 3]


def test_a_share_of_the_full_calls_goes_to_the_hybrid_decoder(model, photos) -> None:
    """hybrid_share 1/3: of every three full calls, one goes to the hybrid decoder and two to
    the hardware one, whole; smaller calls to the hardware; the crops as one decoder's."""
    from engines.gpu_decode import GpuJpegDecoder
    from engines.images import DecodeLimits

    spec = model.spec.preprocess
    alone, hardware, hybrid = _PilBatchDecoder(), _PilBatchDecoder(), _PilBatchDecoder()
    plain = GpuJpegDecoder(spec, DecodeLimits(), device="cpu", decode_batch=alone)
    shared = GpuJpegDecoder(
        spec,
        DecodeLimits(),
        device="cpu",
        decode_batch=hardware,
        chunk=2,
        hybrid_decode=hybrid,
        hybrid_min_jpegs=2,
        hybrid_share=1 / 3,
    )
    jpegs = [photos["chelsea"], photos["coffee"], photos["rocket"], photos["astronaut"]] * 3
    jpegs.append(photos["coffee"])  # 13 JPEGs: six full calls of 2, then one of 1
    expected, crops = plain.crops(jpegs), shared.crops(jpegs)
    assert torch.equal(crops.pixels, expected.pixels) and crops.good == expected.good
    assert hybrid.calls == [2, 2] and hardware.calls == [2, 2, 2, 2, 1]


async def test_a_gpu_decode_replica_decodes_the_jpegs_of_waiting_calls_together(
    model_repository, photos, monkeypatch, stand_in_nvjpeg
) -> None:
    """decode: gpu through the stages' own code (a stand-in decoder on the CPU): one decode
    thread; calls that arrive while it decodes are decoded together in its next nvJPEG call,
    in pieces of at most DECODE_BATCH, each scored once decoded; each request keeps its own
    answers in its own order, the junk bytes failing alone."""
    from serve_app.tuning import DECODE_BATCH

    decoder = stand_in_nvjpeg
    config = AppConfig(model_repository=model_repository, decode="gpu")
    group = await StageGroup.create(config, STAGES)
    assert decoder.calls == [2]  # start-up warmed the decode thread before the replica was ready
    decoder.calls.clear()
    decoder.gate.clear()  # the first call holds the decode thread until the others queue
    large = [photos["chelsea"], photos["coffee"]] * 75
    first = asyncio.ensure_future(group.run(batch_of([photos["coffee"]] * 3)))
    await until(lambda: decoder.calls)
    later = asyncio.ensure_future(
        group.run(batch_of([photos["chelsea"], b"junk", photos["coffee"]], [photos["coffee"]]))
    )
    largest = asyncio.ensure_future(group.run(batch_of(large)))
    queue = group.model("").inference._nvjpeg._queue
    await until(lambda: queue.queued_images >= 3 + len(large))
    decoder.gate.set()
    answers = [await first, await later, await largest]
    # 3 alone; then the waiting 3 (the junk is no JPEG) and 150 together, in as few calls of
    # at most DECODE_BATCH as the pieces allow
    assert decoder.calls[0] == 3 and sum(decoder.calls[1:]) == 3 + len(large)
    assert max(decoder.calls) <= DECODE_BATCH
    assert len(decoder.calls) - 1 == -(-(3 + len(large)) // DECODE_BATCH)
    assert len(set(decoder.threads)) == 1
    assert all(t in COFFEE for t in top_classes(answers[0])[0])
    top = top_classes(answers[1])
    assert top[0][0] in CATS and top[0][1] == 3 and top[0][2] in COFFEE
    assert top[1][0] in COFFEE
    top = top_classes(answers[2])[0]
    assert all(t in CATS for t in top[::2]) and all(t in COFFEE for t in top[1::2])


async def test_a_failing_decoder_fails_only_the_requests_it_was_decoding(
    model_repository, photos, monkeypatch, stand_in_nvjpeg
) -> None:
    """nvJPEG itself failing (not one bad JPEG) fails the requests whose JPEGs it held,
    with one answer each; a request of the same call decoded on the CPU is answered."""
    group = await StageGroup.create(
        AppConfig(model_repository=model_repository, decode="gpu"), STAGES
    )

    def broken(requests):
        raise OSError("the decoder is gone")

    monkeypatch.setattr(group.model("").inference._nvjpeg._decoder, "crops_many", broken)
    png = encode(np.asarray(Image.open(io.BytesIO(photos["coffee"]))), "PNG")
    answers = await group.run(batch_of([photos["chelsea"], png], [png]))
    assert len(answers) == 2
    assert answers[0].code == 13 and "the decoder is gone" in answers[0].message  # INTERNAL
    assert answers[1].code == 0 and top_classes(answers[1:])[0][0] in COFFEE


async def test_a_preprocess_deployment_of_its_own_decodes_and_hands_the_crops_on(
    model_repository, photos, monkeypatch, stand_in_nvjpeg
) -> None:
    """experimental.preprocess_decodes_on_gpu (a stand-in decoder on the CPU):
    the Preprocess replica decodes (warmed before it is ready), in pieces of at most
    DECODE_BATCH, and passes one tensor of crops on (GPU-decoded and host-decoded rows
    together); the Inference replica decodes nothing. Each request is answered in its own
    order, the junk failing alone; nvJPEG itself failing fails only its piece's jobs."""
    from serve_app.tuning import DECODE_BATCH

    decoder = stand_in_nvjpeg
    config = AppConfig(
        model_repository=model_repository,
        decode="gpu",
        experimental={"preprocess_decodes_on_gpu": True},
        stage_ports=(9100, 9163),
    )
    preprocess = await StageGroup.create(config, ("preprocess",))
    rest = await StageGroup.create(config, ("inference", "postprocess"))
    assert decoder.calls == [2]  # the Preprocess replica warmed its decoder
    assert rest.model("").inference._nvjpeg is None
    png = encode(np.asarray(Image.open(io.BytesIO(photos["coffee"]))), "PNG")
    large = [photos["chelsea"], photos["coffee"]] * 40
    batch = batch_of([photos["chelsea"], png, b"junk", photos["coffee"]], large)
    decoded = await preprocess.run(batch)
    assert isinstance(decoded.crops, torch.Tensor) and len(decoded.crops) == 3 + len(large)
    assert decoded.jpegs == () and sorted(decoder.calls[1:]) == [18, DECODE_BATCH]
    top = top_classes(await rest.run(decoded))
    assert top[0][0] in CATS and top[0][1] in COFFEE and top[0][2] == 3
    assert top[0][3] in COFFEE
    assert all(t in CATS for t in top[1][::2]) and all(t in COFFEE for t in top[1][1::2])

    def broken(requests):
        raise OSError("the decoder is gone")

    monkeypatch.setattr(preprocess.model("").preprocess._nvjpeg._decoder, "crops_many", broken)
    answers = await rest.run(await preprocess.run(batch_of([photos["chelsea"]], [png])))
    assert answers[0].code == 13 and "the decoder is gone" in answers[0].message  # INTERNAL
    assert answers[1].code == 0 and top_classes(answers[1:])[0][0] in COFFEE


def test_preprocess_decodes_on_gpu_only_in_a_preprocess_deployment_of_its_own(
    model_repository,
) -> None:
    apart = {"preprocess_decodes_on_gpu": True}
    right = {"decode": "gpu", "experimental": apart, "stage_ports": (9100, 9163)}
    AppConfig(model_repository=model_repository, **right)
    for wrong in (
        {"decode": "cpu"},
        {"topology": "fused"},
        {"topology": "direct"},
        {"topology": [["preprocess", "inference"], ["postprocess"]]},
        {"experimental": {**apart, "gpu_hybrid_decode": True}},
        {"stage_ports": None},
    ):
        with pytest.raises(ValueError, match="preprocess_decodes_on_gpu needs"):
            AppConfig(
                model_repository=model_repository,
                **{**right, **wrong},
            )


@pytest.mark.parametrize("preprocess_apart", [False, True])
async def test_a_decoder_warm_up_given_up_leaves_nothing_running(
    model_repository, monkeypatch, stand_in_nvjpeg, caplog, preprocess_apart
) -> None:
    """nvJPEG's warm-up hangs (a stand-in on the CPU): the load is given up at
    LOAD_TIMEOUT_S, and the stage it was building leaves no batcher worker pending
    (garbage-collected later as "Task was destroyed but it is pending") and waits for no
    stuck decode thread."""
    import gc

    from engines import gpu_decode

    release = threading.Event()
    monkeypatch.setattr(gpu_decode.GpuJpegDecoder, "warmup", lambda self: release.wait(30))
    monkeypatch.setattr(tuning, "LOAD_TIMEOUT_S", 0.5)
    settings = {"experimental": {"preprocess_decodes_on_gpu": True}, "stage_ports": (9100, 9163)}
    config = AppConfig(
        model_repository=model_repository,
        decode="gpu",
        **(settings if preprocess_apart else {}),
    )
    stages = ("preprocess",) if preprocess_apart else STAGES
    before = asyncio.all_tasks()  # other tests' stages may share this event loop
    try:
        with pytest.raises(RuntimeError, match=r"ran past its load timeout"):
            await asyncio.wait_for(StageGroup.create(config, stages), 10)

        def pending() -> list[asyncio.Task]:
            started = asyncio.all_tasks() - before
            return [t for t in started if "DynamicBatcher" in repr(t.get_coro())]

        await until(lambda: not pending())  # the cancelled workers end
        gc.collect()
        await asyncio.sleep(0)  # yields to the loop: a task destroyed pending is logged
        assert not pending(), pending()
        assert "Task was destroyed but it is pending" not in caplog.text
    finally:
        release.set()
