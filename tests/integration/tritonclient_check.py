"""Run by tests/integration/test_tritonclient.py in its own venv (.venv-triton: Triton's
`tritonclient` needs protobuf < 7, raystream pins 7): Triton's own gRPC client, unchanged,
against raystream.
Prints one JSON object with what it saw.

    .venv-triton/bin/python tests/integration/tritonclient_check.py 127.0.0.1:9000 1,2 a.jpg b.jpg

(1,2: the versions in the server's repository, older first; the newer one serves.)
"""

import json
import os
import queue
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

MODEL = "efficientnet-lite0"


def inputs_for(images: list[bytes]) -> list:
    tensor = triton.InferInput("images", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_))
    return [tensor]


def main() -> None:
    address, versions, paths = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    images = [Path(p).read_bytes() for p in paths]
    client = triton.InferenceServerClient(address)
    seen = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(MODEL),
        "inputs": [i.name for i in client.get_model_metadata(MODEL).inputs],
    }
    result = client.infer(
        MODEL,
        inputs_for(images),
        outputs=[
            triton.InferRequestedOutput("probabilities"),
            triton.InferRequestedOutput("labels", class_count=3),
        ],
    )
    probabilities = result.as_numpy("probabilities")
    seen["top1"] = [int(i) for i in probabilities.argmax(axis=1)]
    seen["labels"] = [[x.decode() for x in row] for row in result.as_numpy("labels")]
    try:
        client.infer(MODEL, inputs_for([b"not an image"]))
    except InferenceServerException as exc:
        seen["bad_image_status"] = exc.status()
    # Triton's streaming API (ModelStreamInfer): one answer per request, errors in-band.
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for i, batch in enumerate([images[:1], [b"junk"], images[1:2]]):
        client.async_stream_infer(MODEL, inputs_for(batch), request_id=str(i))
    stream = [answers.get(timeout=60) for _ in range(3)]
    client.stop_stream()
    # Answers come in completion order: successes carry their request id, errors do not.
    seen["stream"] = {
        r.get_response().id: int(r.as_numpy("probabilities").argmax())
        for r, error in stream
        if error is None
    }
    seen["stream_errors"] = [str(error) for _, error in stream if error is not None]
    # Triton's model configuration and model repository extensions.
    config = client.get_model_config(MODEL).config
    seen["config"] = {
        "max_batch_size": config.max_batch_size,
        "inputs": [i.name for i in config.input],
        "optional": [i.optional for i in config.input],
        "outputs": [o.name for o in config.output],
    }
    index = client.get_model_repository_index().models
    seen["index"] = sorted([m.name, m.version, m.state] for m in index)
    control = {"authorization": f"Bearer {os.environ['CONTROL_TOKEN']}"}  # model control's
    policy = {"version_policy": {"specific": {"versions": [int(v) for v in versions]}}}
    client.load_model(MODEL, config=json.dumps(policy), headers=control)
    seen["ready_after_load"] = [client.is_model_ready(MODEL, v) for v in versions]
    client.unload_model(MODEL, headers=control)
    seen["ready_after_unload"] = client.is_model_ready(MODEL)
    try:
        client.infer(MODEL, inputs_for(images[:1]))
    except InferenceServerException as exc:
        seen["unloaded_status"] = exc.status()
    client.load_model(MODEL, headers=control)  # its version policy from the server's config
    seen["ready_after_reload"] = client.is_model_ready(MODEL)
    seen["index_ready"] = sorted(
        [m.name, m.version, m.state]
        for m in client.get_model_repository_index().models
        if m.state == "READY"
    )
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
