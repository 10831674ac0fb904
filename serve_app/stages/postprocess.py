"""The postprocess stage: each job's answer, in its protocol, from the batch's top-k and
embedding arrays (serve_app/wire/answers.py). Plain code: the Postprocess deployment hosts it, or
the Inference deployment or the ingress where the topology fuses them."""

from __future__ import annotations

import dataclasses
import time

from engines.repository import ModelSpec
from raystream.v1 import classifier_pb2 as pb
from serve_app.core.messages import Answer, Batch, copied
from serve_app.wire.answers import answer_all


class PostprocessStage:
    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec

    async def run(self, batch: Batch) -> list[Answer]:
        start = time.perf_counter()
        answers = answer_all(batch, self._spec)
        ms = (time.perf_counter() - start) * 1000.0
        # The time is known once the answers are built: merged into each v1 answer's bytes.
        merged = pb.ClassifyResponse(timing=pb.Timing(postprocess_ms=ms)).SerializeToString()
        timing = dataclasses.replace(batch.timing, postprocess_ms=ms)  # every answer's
        return [
            copied(answer, payload=answer.payload + merged, timing=timing)
            if job.protocol == "v1" and answer.code == 0
            else answer
            for job, answer in zip(batch.jobs, answers, strict=True)
        ]
