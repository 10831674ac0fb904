"""Each protocol's answer, built where the results are (the postprocess stage) as response
bytes, so the ingress only writes them: raystream.v1 `ClassifyResponse` or the Open Inference
Protocol's `ModelInferResponse`. Also the answers the ingress makes itself (refusals,
failures of a whole call).

The ingress adds its own times (end to end, and the wait for a call) by appending a serialized
`ClassifyResponse` holding only `timing.total_ms` and `timing.dispatch_ms`: protobuf merges
concatenated messages field by field (`with_ingress_times`).

An answer is built from its images' fragments (messages.Fragment), so the ingress' result
cache (serve_app/core/result_cache.py) builds an answer from fragments it kept with the same
functions (`v1_answer`, `oip_answer`).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections import Counter
from collections.abc import Sequence

import numpy as np

from engines.repository import ModelSpec
from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.v1 import classifier_pb2 as pb
from serve_app.core.messages import Answer, Batch, Failure, Fragment, Job, OipOutput, StageTiming
from serve_app.errors import Code

# OIP tensor names (serve_app/protocol/oip.py documents the model interface)
OIP_IMAGES, OIP_PIXELS, OIP_SCORES, OIP_LABELS = "images", "pixels", "probabilities", "labels"
OIP_EMBEDDING = "embedding"
OIP_EMBEDDING_FP16 = "embedding_fp16"  # the same vectors as FP16: half the bytes


def failed(job: Job, failure: Failure, timing: StageTiming | None = None) -> Answer:
    """A request that failed as a whole."""
    if job.protocol == "oip":
        return Answer(b"", failure.code, message=failure.message, timing=timing or StageTiming())
    response = pb.ClassifyResponse(request_id=job.id)
    response.error.code, response.error.message = failure.code, failure.message
    return Answer(response.SerializeToString(), failure.code, message=failure.message)


def with_ingress_times(payload: bytes, total_ms: float, dispatch_ms: float) -> bytes:
    """A v1 response's bytes with timing.total_ms and dispatch_ms set (merged in, not
    re-encoded)."""
    timing = pb.Timing(total_ms=total_ms, dispatch_ms=dispatch_ms)
    return payload + pb.ClassifyResponse(timing=timing).SerializeToString()


def answer_all(batch: Batch, spec: ModelSpec) -> list[Answer]:
    """Every job of a batch that went through inference, answered in its protocol (`spec`:
    the labels, and what OIP answers name). Each answer is built from its images' fragments
    (`v1_answer`, `oip_answer`), which it carries too where its job asks (`Job.fragments`)."""
    rows_of: dict[int, list[int]] = {}
    for row, job_index in enumerate(batch.owners[:, 0].tolist()):
        rows_of.setdefault(job_index, []).append(row)
    image_of = batch.owners[:, 1].tolist()
    results = _V1Results(batch, _label_entries(spec.labels))
    answers = []
    for index, job in enumerate(batch.jobs):
        failure = batch.job_failures.get(index)
        if failure is not None:
            answers.append(failed(job, failure, batch.timing))
            continue
        rows = {image_of[row]: row for row in rows_of.get(index, ())}
        fragments: list[Fragment | Failure] = []
        for image in range(job.count):
            row = rows.get(image)
            if row is None:
                fragments.append(batch.image_failures[index, image])
            elif job.protocol == "oip":
                fragments.append(_oip_rows(batch, row, job, spec))
            else:
                fragments.append(results.of(row, job))
        if job.protocol == "oip":
            widths = oip_widths(job.oip_outputs, spec.num_classes, spec.embedding_dim)
            answer = oip_answer(job, spec.name, spec.version, widths, fragments, batch.timing)
        else:
            answer = v1_answer(job, fragments, batch.timing)
        if job.fragments:
            answer = dataclasses.replace(answer, fragments=tuple(fragments))
        answers.append(answer)
    return answers


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def embedding_bytes(vector: np.ndarray, fp16: bool = False) -> bytes:
    """`vector` as a serialized raystream.v1 `Embedding`: its packed `values` are the
    vector's little-endian float32 bytes after a header (field 1, length-delimited), or
    (`fp16`) `values_fp16` its halves (field 2). Merged into a result, 4x faster than
    filling `values` from Python floats."""
    if fp16:
        return b"\x12" + _varint(2 * len(vector)) + vector.astype("<f2").tobytes()
    return b"\x0a" + _varint(4 * len(vector)) + vector.astype("<f4", copy=False).tobytes()


# -- raystream.v1: a ClassifyResponse is its request_id, its results (field 2, each one
# length-delimited entry, in image order) and its timing: the bytes SerializeToString writes.


LabelEntries = tuple[tuple[bytes, ...], tuple[bytes, ...]]
ZERO_FLOAT = bytes(4)  # a score of 0.0 as float32, which proto3 leaves out


@functools.lru_cache(maxsize=8)
def _label_entries(labels: tuple[str, ...]) -> LabelEntries:
    """Each class's `Label` as a field-1 entry of an ImageResult, up to its score's 4 bytes,
    and whole for a score of 0 (proto3 writes no zero): the bytes SerializeToString writes,
    made once per model instead of a message per label."""
    scored, unscored = [], []
    for class_id, name in enumerate(labels):
        head = pb.Label(class_id=class_id, name=name).SerializeToString()
        scored.append(b"\x0a" + _varint(len(head) + 5) + head + b"\x1d")  # field 3, fixed32
        unscored.append(b"\x0a" + _varint(len(head)) + head)
    return tuple(scored), tuple(unscored)


class _V1Results:
    """Each image's `ImageResult` as a field-2 entry of a ClassifyResponse. The batch's top-k
    ids and scores are read out of their arrays once, not row by row (numpy's per-call cost
    was most of the time per image)."""

    def __init__(self, batch: Batch, entries: LabelEntries) -> None:
        self._scored, self._unscored = entries
        self._embeddings = batch.embeddings
        self._ids = self._scores = None
        if batch.top_ids is not None:
            self._ids = batch.top_ids.tolist()
            raw = batch.top_scores.astype("<f4", copy=False).tobytes()
            width = 4 * batch.top_scores.shape[1]
            self._scores = [raw[lo : lo + width] for lo in range(0, len(raw), width)]

    def of(self, row: int, job: Job) -> bytes:
        parts = []
        if job.labels:
            scored, unscored, raw = self._scored, self._unscored, self._scores[row]
            for i, class_id in enumerate(self._ids[row][: job.top_k]):
                score = raw[4 * i : 4 * i + 4]
                parts += (scored[class_id], score) if score != ZERO_FLOAT else (unscored[class_id],)
        if job.embedding:  # field 3, after the labels (field 1): as SerializeToString orders them
            vector = embedding_bytes(self._embeddings[row], job.embedding_fp16)
            parts += (b"\x1a", _varint(len(vector)), vector)
        data = b"".join(parts)
        return b"\x12" + _varint(len(data)) + data


def _v1_error(failure: Failure) -> bytes:
    data = pb.ImageResult(error=pb.Error(code=failure.code, message=failure.message))
    data = data.SerializeToString()
    return b"\x12" + _varint(len(data)) + data


def _all_ok(images: int) -> tuple[tuple[int, int], ...]:
    """An answer's image codes when every image succeeded: none for a request of none."""
    return ((0, images),) if images else ()


def v1_answer(job: Job, fragments: Sequence[Fragment | Failure], timing: StageTiming) -> Answer:
    """A v1 request's answer from its images' fragments (or failures), in image order."""
    if not any(isinstance(fragment, Failure) for fragment in fragments):
        image_codes, entries = _all_ok(len(fragments)), fragments
    else:
        codes: Counter[int] = Counter()
        entries = []
        for fragment in fragments:
            if isinstance(fragment, Failure):
                codes[fragment.code] += 1
                entries.append(_v1_error(fragment))
            else:
                codes[0] += 1
                entries.append(fragment)
        image_codes = tuple(codes.items())
    payload = _request_id_bytes(job.id) + b"".join(entries) + _timing_bytes(timing)
    return Answer(payload, 0, image_codes=image_codes, timing=timing)


def _request_id_bytes(request_id: str) -> bytes:
    """A ClassifyResponse's `request_id` (field 1), as SerializeToString writes it."""
    if not request_id:
        return b""
    data = request_id.encode()
    return b"\x0a" + _varint(len(data)) + data


@functools.lru_cache(maxsize=64)  # a call's answers share one timing
def _timing_bytes(t: StageTiming) -> bytes:
    timing = pb.Timing(
        preprocess_ms=t.preprocess_ms,
        queue_ms=t.queue_ms,
        inference_ms=t.inference_ms,
        postprocess_ms=t.postprocess_ms,
        batch_size=t.batch_size,
    )
    return pb.ClassifyResponse(timing=timing).SerializeToString()


# -- Open Inference Protocol: each output is an [N, width] tensor whose raw contents are its
# images' rows, concatenated in image order.


def oip_widths(
    outputs: Sequence[OipOutput], num_classes: int, embedding_dim: int
) -> tuple[int, ...]:
    """Each output's elements per image."""
    width = {"probabilities": num_classes, "embedding": embedding_dim}
    width["embedding_fp16"] = embedding_dim
    return tuple(width.get(output.kind, output.k) for output in outputs)


def answer_bytes_bound(job: Job, num_classes: int, embedding_dim: int, label_bytes: int) -> int:
    """The most bytes `job`'s answer can take, in either protocol, known before any work:
    `label_bytes` is the model's longest label. A label costs its name and at most
    LABEL_OVERHEAD_BYTES beside it (OIP's length prefix, score, class id and separators;
    raystream.v1's field tags, lengths, class id and score)."""
    label = LABEL_OVERHEAD_BYTES + len(str(num_classes)) + label_bytes
    vector = 4 * embedding_dim + 8
    if job.protocol == "oip":
        width = {"probabilities": 4 * num_classes, "embedding": vector, "embedding_fp16": vector}
        per_image = sum(width.get(out.kind, out.k * label) for out in job.oip_outputs)
    else:
        per_image = job.labels * job.top_k * label + job.embedding * vector
    return ANSWER_OVERHEAD_BYTES + job.count * (per_image + IMAGE_OVERHEAD_BYTES)


LABEL_OVERHEAD_BYTES = 24
IMAGE_OVERHEAD_BYTES = 16  # an image's result entry (v1), or nothing (OIP)
ANSWER_OVERHEAD_BYTES = 4096  # the id, model, tensors' headers, timing, error message


def _oip_rows(batch: Batch, row: int, job: Job, spec: ModelSpec) -> tuple[bytes, ...]:
    """One image's row of each output the job asked for."""
    out = []
    for output in job.oip_outputs:
        if output.kind == "probabilities":
            out.append(batch.probabilities[row].astype("<f4", copy=False).tobytes())
        elif output.kind == "embedding":
            out.append(batch.embeddings[row].astype("<f4", copy=False).tobytes())
        elif output.kind == "embedding_fp16":
            out.append(batch.embeddings[row].astype("<f2").tobytes())
        else:
            elements = [
                f"{score:f}:{class_id}:{spec.labels[class_id]}".encode()
                for class_id, score in zip(
                    batch.top_ids[row, : output.k].tolist(),
                    batch.top_scores[row, : output.k].tolist(),
                    strict=True,
                )
            ]
            out.append(b"".join(struct.pack("<I", len(e)) + e for e in elements))
    return tuple(out)


def oip_answer(
    job: Job,
    name: str,
    version: str,
    widths: Sequence[int],
    fragments: Sequence[Fragment | Failure],
    timing: StageTiming,
) -> Answer:
    """An OIP request's answer from its images' rows (or failures), in image order. OIP has
    no per-image errors: a bad image fails the request, naming the image."""
    for image, fragment in enumerate(fragments):
        if isinstance(fragment, Failure):
            message = f"image {image}: {fragment.message}"
            return Answer(b"", int(Code.INVALID_ARGUMENT), message=message, timing=timing)
    response = oip.ModelInferResponse(model_name=name, model_version=version, id=job.id)
    for index, (output, width) in enumerate(zip(job.oip_outputs, widths, strict=True)):
        datatype = {"labels": "BYTES", "embedding_fp16": "FP16"}.get(output.kind, "FP32")
        response.outputs.add(name=output.name, datatype=datatype, shape=[len(fragments), width])
        response.raw_output_contents.append(b"".join(rows[index] for rows in fragments))
    return Answer(
        response.SerializeToString(), 0, image_codes=_all_ok(len(fragments)), timing=timing
    )
