"""serve_app/answers.py: a v1 answer's bytes are exactly what protobuf writes for the same
results (the stage writes the wire format itself, from bytes made once per model)."""

from __future__ import annotations

import numpy as np

from raystream.v1 import classifier_pb2 as pb
from serve_app.answers import answer_all
from serve_app.messages import Batch, Job, StageTiming


def test_v1_answers_are_the_bytes_protobuf_writes(model) -> None:
    spec = model.spec
    rng = np.random.default_rng(0)
    rows = 6
    top_ids = rng.integers(0, spec.num_classes, (rows, 5))
    top_ids[0, 0] = 0  # class 0: proto3 writes no class_id
    top_scores = rng.random((rows, 5), dtype=np.float32)
    top_scores[1, 4] = 0.0  # a score of 0: no score field
    embeddings = rng.standard_normal((rows, spec.embedding_dim)).astype(np.float32)
    jobs = (
        Job(id="a", images=(b"x",) * 3, top_k=5),
        Job(id="b", images=(b"x",) * 3, top_k=2, embedding=True),
    )
    owners = np.array([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]], np.int32)
    timing = StageTiming(queue_ms=1.5, inference_ms=2.5, batch_size=6)
    batch = Batch(
        jobs=jobs,
        owners=owners,
        top_ids=top_ids,
        top_scores=top_scores,
        embeddings=embeddings,
        timing=timing,
    )
    answers = answer_all(batch, spec)
    for job, answer, first in zip(jobs, answers, (0, 3), strict=True):
        expected = pb.ClassifyResponse(request_id=job.id)
        for row in range(first, first + 3):
            result = expected.results.add()
            k = job.top_k
            for class_id, score in zip(top_ids[row, :k], top_scores[row, :k], strict=True):
                result.labels.add(
                    class_id=int(class_id), name=spec.labels[class_id], score=float(score)
                )
            if job.embedding:
                result.embedding.values.extend(embeddings[row].tolist())
        expected.timing.CopyFrom(
            pb.Timing(queue_ms=timing.queue_ms, inference_ms=timing.inference_ms, batch_size=6)
        )
        assert answer.payload == expected.SerializeToString()
