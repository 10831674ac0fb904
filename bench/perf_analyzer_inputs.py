"""Input data for Triton's perf_analyzer (`--input-data FILE`) against raystream's OIP endpoint.

    python bench/perf_analyzer_inputs.py OUT_DIR
    bench/perf_analyzer.sh -i grpc -u 127.0.0.1:9000 -m efficientnet-lite0 \
        --input-data OUT_DIR/images.json

Writes two files, one step per photo (perf_analyzer cycles through the steps):
- images.json: `images`, BYTES (one element a request), each step one of the seven
  built-in photos as a JPEG (base64 of Triton's raw BYTES form: its length, then the JPEG);
- pixels.json: `pixels`, FP32 [3, H, W], the same photos preprocessed as the model expects
  (resize, center crop, mean/std), raw little-endian float32 (base64).
The model interface has both inputs optional (ModelConfig): each request carries only the
input that the file names.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import struct
from pathlib import Path

import numpy as np
from load import builtin_photos
from PIL import Image

from engines.base import normalize
from engines.export import DEFAULT_MODEL
from engines.images import crop_to_input
from engines.repository import resolve


def write_inputs(out: Path, repository: Path, model: str) -> tuple[Path, Path]:
    """images.json and pixels.json in `out`, the latter for `model`'s newest version."""
    spec = resolve(repository, model).spec.preprocess
    out.mkdir(parents=True, exist_ok=True)
    jpegs = builtin_photos()
    # perf_analyzer sends a BYTES tensor's b64 as it decodes: in Triton's raw form already
    images = [{"images": {"b64": _b64(struct.pack("<I", len(jpeg)) + jpeg)}} for jpeg in jpegs]
    pixels = []
    for jpeg in jpegs:
        photo = Image.open(io.BytesIO(jpeg)).convert("RGB")
        crop = normalize(crop_to_input(photo, spec)[None], spec.mean_array, spec.std_array)[0]
        raw = np.ascontiguousarray(crop, dtype="<f4").tobytes()
        pixels.append({"pixels": {"b64": _b64(raw), "shape": crop.shape}})
    paths = out / "images.json", out / "pixels.json"
    for path, steps in zip(paths, (images, pixels), strict=True):
        path.write_text(json.dumps({"data": steps}, default=list))
    return paths


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for images.json and pixels.json")
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    for path in write_inputs(args.out, args.model_repository, args.model):
        print(path)


if __name__ == "__main__":
    main()
