"""Decode fidelity: real photos (skimage.data) re-encoded with PIL at the sizes where decoders
differ, the model's reference preprocessing, and the check every decode path passes
(tests/unit/test_fidelity.py runs the CPU paths, tests/gpu/test_gpu_fidelity.py nvJPEG's).

The reference: PIL's full decode (EXIF orientation applied, RGB), a bilinear resize of the
whole image to a short side of `resize_size`, the center `input_size` crop, the model's
mean/std, the exported ONNX model's `embedding` output. A decode path passes when every
photo's embedding is within cosine MIN_COSINE of the reference's and its top-1 class is the
reference's wherever the reference's top-1 leads its second by more than TOP1_LEAD.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

MIN_COSINE = 0.998
TOP1_LEAD = 0.02
PHOTOS = ("astronaut", "coffee", "rocket")  # 512x512, 600x400 and 427x640 at their own sizes
# (kind, sizes): 2x, 4x and 8x the crop (224) and the resize size (256), odd sizes (one
# smaller than the resize, one DCT-scaled whose sides do not divide by the scale).
SIZES = {
    "2/4/8x crop": ((448, 448), (896, 896), (1792, 1792)),
    "2/4/8x resize": ((512, 512), (1024, 1024), (2048, 2048)),
    "odd": ((513, 769), (769, 513), (300, 200), (1537, 2049)),
}
ROTATED = ((769, 513), (2048, 1536))  # as displayed; stored turned, with the EXIF orientation


@dataclass(frozen=True)
class Sample:
    name: str  # photo and size, e.g. "astronaut 1024x1024 progressive"
    kind: str  # the class of photos it reports under
    data: bytes  # encoded


def _encode(image: Image.Image, fmt: str = "JPEG", **params: object) -> bytes:
    buffer = io.BytesIO()
    if fmt == "JPEG":
        params = {"quality": 90, **params}
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def _mosaic(side: int) -> Image.Image:
    """A side x side image of 512x512 tiles of photos at their own resolution: detail at full
    size, which a photo enlarged to that size lacks."""
    from skimage import data

    tiles = [data.astronaut(), data.coffee(), data.rocket(), data.chelsea(), data.retina()]
    tiles += [np.stack([data.grass()] * 3, axis=-1), data.immunohistochemistry()]
    out = np.zeros((side, side, 3), np.uint8)
    for index, (top, left) in enumerate(
        (top, left) for top in range(0, side, 512) for left in range(0, side, 512)
    ):
        tile = tiles[index % len(tiles)]
        if min(tile.shape[:2]) < 512:
            tile = np.asarray(Image.fromarray(tile).resize((512, 512), Image.Resampling.LANCZOS))
        out[top : top + 512, left : left + 512] = tile[:512, :512]
    return Image.fromarray(out)


def fidelity_set() -> list[Sample]:
    """The photos every decode path is checked on, made here from skimage.data (none
    downloaded): JPEG at each size of SIZES, grayscale, progressive, EXIF orientations 6 and
    8, PNG, the photos at their own sizes, and mosaics of photos at 2048, 3072 and 4096."""
    from skimage import data

    samples = []
    for name in PHOTOS:
        photo = Image.fromarray(getattr(data, name)())
        samples.append(Sample(f"{name} own size", "own size", _encode(photo)))

        def sized(size: tuple[int, int], photo: Image.Image = photo) -> Image.Image:
            return photo.resize(size, Image.Resampling.LANCZOS)

        for kind, sizes in SIZES.items():
            for w, h in sizes:
                samples.append(Sample(f"{name} {w}x{h}", kind, _encode(sized((w, h)))))
        for w, h in ((512, 512), (2048, 1536)):
            gray = sized((w, h)).convert("L")
            samples.append(Sample(f"{name} {w}x{h} L", "grayscale", _encode(gray)))
            png = _encode(sized((w, h)), "PNG", compress_level=1)
            samples.append(Sample(f"{name} {w}x{h} PNG", "PNG", png))
        for side in (1024, 2048):
            progressive = _encode(sized((side, side)), progressive=True)
            samples.append(Sample(f"{name} {side}x{side} progressive", "progressive", progressive))
        for orientation, turn in ((6, Image.Transpose.ROTATE_90), (8, Image.Transpose.ROTATE_270)):
            for w, h in ROTATED:
                exif = Image.Exif()
                exif[0x0112] = orientation  # displayed: turned back to w x h
                stored = _encode(sized((w, h)).transpose(turn), exif=exif.tobytes())
                samples.append(Sample(f"{name} {w}x{h} EXIF {orientation}", "EXIF-rotated", stored))
    for side in (2048, 3072, 4096):
        samples.append(Sample(f"mosaic {side}x{side}", "mosaic", _encode(_mosaic(side))))
    return samples


def reference_crop(data: bytes, input_size: int, resize_size: int) -> np.ndarray:
    """The reference preprocessing's crop: uint8 (input_size, input_size, 3)."""
    with Image.open(io.BytesIO(data)) as image:
        image = ImageOps.exif_transpose(image).convert("RGB")
    width, height = image.size
    scale = resize_size / min(width, height)
    new_w = max(input_size, round(width * scale))
    new_h = max(input_size, round(height * scale))
    resized = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left, top = (new_w - input_size) // 2, (new_h - input_size) // 2
    return np.asarray(resized.crop((left, top, left + input_size, top + input_size)))


class ReferenceModel:
    """The exported ONNX model on ONNX Runtime's CPU provider: crops -> (softmax, embedding)."""

    def __init__(self, model) -> None:
        import onnxruntime as ort

        self._spec = model.spec.preprocess
        self._session = ort.InferenceSession(
            str(model.onnx_path), providers=["CPUExecutionProvider"]
        )

    def __call__(self, crops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from engines.base import normalize
        from engines.scores import softmax

        spec = self._spec
        batch = normalize(crops, spec.mean_array, spec.std_array)
        logits, embedding = self._session.run(["logits", "embedding"], {"input": batch})
        return softmax(logits), embedding


@dataclass(frozen=True)
class Fidelity:
    """One decode path against the reference on a fidelity set."""

    path: str
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    cosines: np.ndarray  # per photo
    top1_differs: tuple[str, ...]  # photos whose reference top-1 leads and whose top-1 differs

    def min_by_kind(self) -> dict[str, float]:
        table: dict[str, float] = {}
        for kind, cosine in zip(self.kinds, self.cosines, strict=True):
            table[kind] = min(table.get(kind, 1.0), float(cosine))
        return table

    def failures(self) -> list[str]:
        """What fails MIN_COSINE or the top-1 rule, one line each (empty: the path passes)."""
        low = [
            f"{self.path}: {name} cosine {cosine:.4f} < {MIN_COSINE}"
            for name, cosine in zip(self.names, self.cosines, strict=True)
            if cosine < MIN_COSINE
        ]
        return low + [f"{self.path}: {name} top-1 differs" for name in self.top1_differs]


class Reference:
    """The reference's outputs on a fidelity set, computed once; `compare` a path's crops."""

    def __init__(self, model, samples: list[Sample]) -> None:
        spec = model.spec.preprocess
        self.samples = samples
        self.model = ReferenceModel(model)
        crops = np.stack(
            [reference_crop(s.data, spec.input_size, spec.resize_size) for s in samples]
        )
        self.probabilities, self.embedding = self.model(crops)

    def compare(self, path: str, crops: np.ndarray, chosen: list[int] | None = None) -> Fidelity:
        """`crops`: the path's uint8 crops of the samples at `chosen` (all when None)."""
        chosen = list(range(len(self.samples))) if chosen is None else chosen
        probabilities, embedding = self.model(crops)
        reference, ref_embedding = self.probabilities[chosen], self.embedding[chosen]
        a, b = embedding.astype(np.float64), ref_embedding.astype(np.float64)
        cosines = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        top2 = np.sort(reference, axis=1)[:, -2:]
        leads = top2[:, 1] - top2[:, 0] > TOP1_LEAD
        differs = leads & (probabilities.argmax(1) != reference.argmax(1))
        names = tuple(self.samples[i].name for i in chosen)
        return Fidelity(
            path,
            names,
            tuple(self.samples[i].kind for i in chosen),
            cosines,
            tuple(name for name, bad in zip(names, differs, strict=True) if bad),
        )

    def check(self, path: str, decode: Callable[[bytes], np.ndarray]) -> Fidelity:
        """`decode` (bytes -> uint8 crop) on every sample, compared."""
        return self.compare(path, np.stack([decode(sample.data) for sample in self.samples]))
