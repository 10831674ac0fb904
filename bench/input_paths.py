# Kept: a correctness check of every input path, not a load; tests/test_server.py imports it.
"""Every input path of a running server against its own answer for encoded photos, whatever
engine it runs (written to run the GPU engines' client-preprocessed paths on a GPU):

  v1 images        raystream.v1 ClassifyOnce, JPEG bytes (the reference)
  v1 stream        raystream.v1 Classify, the same photos over one bidi stream
  v1 pixels        raystream.v1 ClassifyOnce, `pixels`: float32 model input this client made
                   with the server's own preprocessing code (PIL)
  oip images       Open Inference Protocol ModelInfer, BYTES input `images`
  oip pixels       ModelInfer, FP32 input `pixels`
  oip stream       ModelStreamInfer, one photo per request

and that bad input fails alone with INVALID_ARGUMENT (a junk image among good ones, pixels of
the wrong shape, pixels holding NaN). Prints one row per path: top-1 agreement with the
reference and the largest difference of the winner's probability; exits 1 when a winner
differs or an error code is wrong. Against a server decoding with nvJPEG (`decode: gpu`),
the client's PIL-made pixels differ in score and, for a close call, in winner (one photo of
seven on the H200): start it with `--decode cpu` to compare like with
like.

    python bench/input_paths.py --server 127.0.0.1:9000 [--repository models]
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.loadgen import builtin_photos, model_input
from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _winners(response: pb.ClassifyResponse) -> list[tuple[int, float]]:
    if response.error.code:
        raise RuntimeError(f"request failed: {response.error.code} {response.error.message}")
    return [(r.labels[0].class_id, r.labels[0].score) for r in response.results]


def _v1_pixels(pixels: np.ndarray, request_id: str) -> pb.ClassifyRequest:
    request = pb.ClassifyRequest(request_id=request_id, top_k=1)
    request.pixels.shape.extend(pixels.shape)
    request.pixels.data = pixels.astype("<f4").tobytes()
    return request


def _oip_images(model: str, images: list[bytes], request_id: str = "i") -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="images", datatype="BYTES", shape=[len(images)])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(e)) + e for e in images))
    return request


def _oip_pixels(model: str, pixels: np.ndarray) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model, id="p")
    request.inputs.add(name="pixels", datatype="FP32", shape=list(pixels.shape))
    request.raw_input_contents.append(pixels.astype("<f4").tobytes())
    return request


def _oip_winners(reply: oip.ModelInferResponse, classes: int) -> list[tuple[int, float]]:
    probabilities = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(-1, classes)
    return [(int(row.argmax()), float(row.max())) for row in probabilities]


async def _code(call) -> grpc.StatusCode | None:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


async def check(server: str, repository: Path) -> int:
    photos = list(builtin_photos())
    async with grpc.aio.insecure_channel(
        server, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        v1 = pb_grpc.ImageClassifierStub(channel)
        kserve = oip_grpc.GRPCInferenceServiceStub(channel)
        info = await v1.GetModelInfo(pb.ModelInfoRequest())
        model, classes = info.name, info.num_classes
        pixels = model_input(repository, model, tuple(photos))

        reference = _winners(await v1.ClassifyOnce(pb.ClassifyRequest(images=photos, top_k=1)))
        streamed = sorted(
            [
                (int(r.request_id), _winners(r)[0])
                async for r in v1.Classify(
                    iter(
                        pb.ClassifyRequest(request_id=str(i), images=[p], top_k=1)
                        for i, p in enumerate(photos)
                    )
                )
            ]
        )  # answered in completion order: sorted back by request id
        paths = {
            "v1 stream": [winner for _, winner in streamed],
            "v1 pixels": _winners(await v1.ClassifyOnce(_v1_pixels(pixels, "p"))),
            "oip images": _oip_winners(
                await kserve.ModelInfer(_oip_images(model, photos)), classes
            ),
            "oip pixels": _oip_winners(
                await kserve.ModelInfer(_oip_pixels(model, pixels)), classes
            ),
        }
        stream_replies = [
            r
            async for r in kserve.ModelStreamInfer(
                iter(_oip_images(model, [p], str(i)) for i, p in enumerate(photos))
            )
        ]
        by_id = {int(r.infer_response.id): r.infer_response for r in stream_replies}
        paths["oip stream"] = [_oip_winners(by_id[i], classes)[0] for i in range(len(photos))]

        # bad input: one junk image fails alone; wrong-shape and NaN pixels are refused
        mixed = await v1.ClassifyOnce(
            pb.ClassifyRequest(images=[photos[0], b"not an image", photos[1]], top_k=1)
        )
        codes = [r.error.code for r in mixed.results]
        nan = pixels[:1].copy()
        nan[0, 0, 0, 0] = np.nan
        errors = {
            "a junk image among good ones: INVALID_ARGUMENT for it alone": codes
            == [0, INVALID.value[0], 0]
            and mixed.results[0].labels[0].class_id == reference[0][0],
            "v1 pixels of the wrong shape: INVALID_ARGUMENT": (
                await v1.ClassifyOnce(_v1_pixels(pixels[:, :, :100, :100], "w"))
            ).error.code
            == INVALID.value[0],
            "v1 pixels holding NaN: INVALID_ARGUMENT": (
                await v1.ClassifyOnce(_v1_pixels(nan, "n"))
            ).error.code
            == INVALID.value[0],
            "oip pixels of the wrong shape: INVALID_ARGUMENT": await _code(
                kserve.ModelInfer(_oip_pixels(model, pixels[:, :, :100, :100]))
            )
            == INVALID,
        }

    print(f"server {server}: {model} on {info.engine} ({info.precision}), {len(photos)} photos")
    print("| path | winners equal to v1 images | max |winner score - v1 images'| |")
    print("|---|---|---|")
    failed = False
    for name, winners in paths.items():
        same = sum(w[0] == r[0] for w, r in zip(winners, reference, strict=True))
        delta = max(abs(w[1] - r[1]) for w, r in zip(winners, reference, strict=True))
        failed |= same != len(reference)
        print(f"| {name} | {same} / {len(reference)} | {delta:.2e} |")
        for i, (w, r) in enumerate(zip(winners, reference, strict=True)):
            if w[0] != r[0]:
                print(
                    f"  photo {i}: class {w[0]} ({w[1]:.3f}), v1 images class {r[0]} ({r[1]:.3f})"
                )
    for name, ok in errors.items():
        failed |= not ok
        print(f"{name}: {'yes' if ok else 'NO'}")
    return int(failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:9000")
    parser.add_argument("--repository", type=Path, default=Path("models"))
    args = parser.parse_args()
    sys.exit(asyncio.run(check(args.server, args.repository)))


if __name__ == "__main__":
    main()
