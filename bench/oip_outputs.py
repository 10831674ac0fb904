# Kept: in-process OIP output cost (no scenario can); docs/protocol.md and serve_app cite it.
"""What each Open Inference Protocol output costs the server, in one run: requests of 8
client-preprocessed images (`pixels`) through the direct topology's services in this process
(no gRPC, no Ray) with the `echo` engine, so only the serving code is timed. Prints ms per
request for the default `probabilities` output (every class's score) and the `labels`
output (top 5), and their ratio.

    python bench/oip_outputs.py --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_overhead import direct_service, identity_repository, tiny_png

from clients.loadgen import model_input
from raystream.oip import grpc_predict_v2_pb2 as oip
from serve_app.oip import OpenInferenceService


async def ms_per_request(service: OpenInferenceService, request, seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await asyncio.gather(*(service._infer(request, None) for _ in range(8)))
        done += 8
    return (time.perf_counter() - start) / done * 1000.0


async def main(seconds: float, repository: Path) -> None:
    identity = identity_repository(repository)
    service = OpenInferenceService(
        await direct_service(identity, "identity", topology="direct", log_sample_rate=0.0)
    )
    pixels = model_input(identity, "identity", (tiny_png(),) * 8)
    results = {}
    for output in ("probabilities", "labels"):
        request = oip.ModelInferRequest(model_name="identity", id="r")
        request.inputs.add(name="pixels", datatype="FP32", shape=list(pixels.shape))
        request.raw_input_contents.append(pixels.astype("<f4").tobytes())
        request.outputs.add(name=output)
        results[output] = await ms_per_request(service, request, seconds)
        print(f"output {output:<13} {results[output]:6.2f} ms per request of 8 images")
    print(f"probabilities / labels: {results['probabilities'] / results['labels']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repository", type=Path, default=Path("models"))
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.repository))
