"""serve_app/wire/answers.py: a v1 answer's bytes are exactly what protobuf writes for the same
results (the stage writes the wire format itself, from bytes made once per model)."""

from __future__ import annotations

import numpy as np
import pytest

from raystream.v1 import classifier_pb2 as pb
from serve_app.core.messages import Batch, Failure, Job, StageTiming, copied
from serve_app.wire.answers import answer_all, oip_answer, v1_answer


def test_v1_answers_are_the_bytes_protobuf_writes(model) -> None:
    spec = model.spec
    rng = np.random.default_rng(0)
    rows = 8
    top_ids = rng.integers(0, spec.num_classes, (rows, 5))
    top_ids[0, 0] = 0  # class 0: proto3 writes no class_id
    top_scores = rng.random((rows, 5), dtype=np.float32)
    top_scores[1, 4] = 0.0  # a score of 0: no score field
    embeddings = rng.standard_normal((rows, spec.embedding_dim)).astype(np.float32)
    jobs = (
        Job(id="a", images=(b"x",) * 3, top_k=5),
        Job(id="b", images=(b"x",) * 3, top_k=2, embedding=True),
        Job(id="", images=(b"x",), top_k=1),  # no id: proto3 writes no request_id
        Job(id="ü" * 100, images=(b"x",), top_k=3),  # a length of two bytes' varint
    )
    owners = np.array([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [2, 0], [3, 0]], np.int32)
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
    for job, answer, first in zip(jobs, answers, (0, 3, 6, 7), strict=True):
        assert answer.image_codes == ((0, job.count),)
        expected = pb.ClassifyResponse(request_id=job.id)
        for row in range(first, first + job.count):
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


def test_a_failed_image_answers_alone_with_its_code(model) -> None:
    jobs = (Job(id="a", images=(b"x",) * 3, top_k=1),)
    batch = Batch(
        jobs=jobs,
        owners=np.array([[0, 0], [0, 2]], np.int32),
        top_ids=np.array([[7], [9]]),
        top_scores=np.array([[0.5], [0.25]], np.float32),
        image_failures={(0, 1): Failure(3, "not an image")},
    )
    (answer,) = answer_all(batch, model.spec)
    assert sorted(answer.image_codes) == [(0, 2), (3, 1)]
    results = pb.ClassifyResponse.FromString(answer.payload).results
    assert [r.labels[0].class_id if r.labels else None for r in results] == [7, None, 9]
    assert (results[1].error.code, results[1].error.message) == (3, "not an image")


def test_a_copy_keeps_the_image_count_and_leaves_the_job_alone() -> None:
    job = Job(id="a", images=(b"x", b"y"), top_k=3)
    bare = job.without_inputs()
    assert (bare.images, bare.count, bare.top_k, bare.id) == ((), 2, 3, "a")
    assert job.images == (b"x", b"y") and bare == copied(job, images=())
    with pytest.raises(TypeError, match="no field imagez"):  # a misspelled field is refused
        copied(job, imagez=())


def test_a_request_of_no_images_reports_no_image_codes() -> None:
    """Image codes count images: a request of none has none, not a count of 0 (a 0 reaches
    Ray's counters, which refuse it)."""
    assert v1_answer(Job(id="empty"), [], StageTiming()).image_codes == ()
    assert oip_answer(Job(id="empty"), "m", "1", [], [], StageTiming()).image_codes == ()
    assert v1_answer(Job(id="one"), [b""], StageTiming()).image_codes == ((0, 1),)
