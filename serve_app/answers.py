"""Each protocol's answer, built where the results are (the postprocess stage) as response
bytes, so the ingress only writes them: raystream.v1 `ClassifyResponse` or the Open Inference
Protocol's `ModelInferResponse`. Also the answers the ingress makes itself (refusals,
failures of a whole call).

The ingress adds the end-to-end time by appending a serialized `ClassifyResponse` holding only
`timing.total_ms`: protobuf merges concatenated messages field by field (`with_total_ms`).
"""

from __future__ import annotations

import struct
from collections import Counter

import numpy as np

from engines.repository import ModelSpec
from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.v1 import classifier_pb2 as pb
from serve_app.errors import Code
from serve_app.messages import Answer, Batch, Failure, Job, StageTiming

# OIP tensor names (serve_app/oip.py documents the model interface)
OIP_IMAGES, OIP_PIXELS, OIP_SCORES, OIP_LABELS = "images", "pixels", "probabilities", "labels"
OIP_EMBEDDING = "embedding"


def failed(job: Job, failure: Failure, timing: StageTiming | None = None) -> Answer:
    """A request that failed as a whole."""
    if job.protocol == "oip":
        return Answer(b"", failure.code, message=failure.message, timing=timing or StageTiming())
    response = pb.ClassifyResponse(request_id=job.id)
    response.error.code, response.error.message = failure.code, failure.message
    return Answer(response.SerializeToString(), failure.code, message=failure.message)


def with_total_ms(payload: bytes, total_ms: float) -> bytes:
    """A v1 response's bytes with timing.total_ms set (merged in, not re-encoded)."""
    return payload + pb.ClassifyResponse(timing=pb.Timing(total_ms=total_ms)).SerializeToString()


def answer_all(batch: Batch, spec: ModelSpec) -> list[Answer]:
    """Every job of a batch that went through inference, answered in its protocol (`spec`:
    the labels, and what OIP answers name)."""
    rows_of: dict[int, list[int]] = {}
    for row, job_index in enumerate(batch.owners[:, 0].tolist()):
        rows_of.setdefault(job_index, []).append(row)
    image_of = batch.owners[:, 1].tolist()
    answers = []
    for index, job in enumerate(batch.jobs):
        failure = batch.job_failures.get(index)
        if failure is not None:
            answers.append(failed(job, failure, batch.timing))
            continue
        rows = {image_of[row]: row for row in rows_of.get(index, ())}
        build = _oip if job.protocol == "oip" else _v1
        answers.append(build(batch, index, job, rows, spec))
    return answers


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def embedding_bytes(vector: np.ndarray) -> bytes:
    """`vector` as a serialized raystream.v1 `Embedding`: its packed `values` are the
    vector's little-endian float32 bytes after a header (field 1, length-delimited). Merged
    into a result, 4x faster than filling `values` from Python floats."""
    return b"\x0a" + _varint(4 * len(vector)) + vector.astype("<f4", copy=False).tobytes()


def _v1(batch: Batch, index: int, job: Job, rows: dict[int, int], spec: ModelSpec) -> Answer:
    response = pb.ClassifyResponse(request_id=job.id)
    codes: Counter[int] = Counter()
    ids, scores = batch.top_ids, batch.top_scores
    embeddings = batch.embeddings if job.embedding else None
    for image in range(job.count):
        result = response.results.add()
        row = rows.get(image)
        if row is None:
            failure = batch.image_failures[index, image]
            result.error.code, result.error.message = failure.code, failure.message
            codes[failure.code] += 1
            continue
        codes[0] += 1
        if job.labels:
            for class_id, score in zip(
                ids[row, : job.top_k].tolist(), scores[row, : job.top_k].tolist(), strict=True
            ):
                result.labels.add(class_id=class_id, name=spec.labels[class_id], score=score)
        if embeddings is not None:
            result.embedding.MergeFromString(embedding_bytes(embeddings[row]))
    t = batch.timing
    timing = response.timing
    timing.preprocess_ms, timing.queue_ms = t.preprocess_ms, t.queue_ms
    timing.inference_ms, timing.postprocess_ms = t.inference_ms, t.postprocess_ms
    timing.batch_size = t.batch_size
    return Answer(response.SerializeToString(), 0, image_codes=tuple(codes.items()), timing=t)


def _oip(batch: Batch, index: int, job: Job, rows: dict[int, int], spec: ModelSpec) -> Answer:
    """OIP has no per-image errors: a bad image fails the request, naming the image."""
    for image in range(job.count):
        if image not in rows:
            failure = batch.image_failures[index, image]
            message = f"image {image}: {failure.message}"
            return Answer(b"", int(Code.INVALID_ARGUMENT), message=message, timing=batch.timing)
    order = [rows[image] for image in range(job.count)]
    response = oip.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=job.id)
    for output in job.oip_outputs:
        if output.kind == "probabilities":
            probabilities = (
                batch.probabilities[order] if order else np.zeros((0, spec.num_classes), np.float32)
            )
            response.outputs.add(name=output.name, datatype="FP32", shape=list(probabilities.shape))
            response.raw_output_contents.append(probabilities.astype("<f4").tobytes())
        elif output.kind == "embedding":
            vectors = (
                batch.embeddings[order] if order else np.zeros((0, spec.embedding_dim), np.float32)
            )
            response.outputs.add(name=output.name, datatype="FP32", shape=list(vectors.shape))
            response.raw_output_contents.append(vectors.astype("<f4").tobytes())
        else:
            elements = [
                f"{score:f}:{class_id}:{spec.labels[class_id]}".encode()
                for row in order
                for class_id, score in zip(
                    batch.top_ids[row, : output.k].tolist(),
                    batch.top_scores[row, : output.k].tolist(),
                    strict=True,
                )
            ]
            response.outputs.add(name=output.name, datatype="BYTES", shape=[job.count, output.k])
            response.raw_output_contents.append(
                b"".join(struct.pack("<I", len(e)) + e for e in elements)
            )
    return Answer(
        response.SerializeToString(), 0, image_codes=((0, job.count),), timing=batch.timing
    )
