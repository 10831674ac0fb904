"""What travels between the ingress and the stages: whole batches of requests, never one
request or one image per message. Frozen dataclasses of tuples and arrays (cheap to pickle
through Ray). No protocol here: the gRPC adapters turn requests into Jobs, and the answer
formats (serve_app/wire/answers.py) turn outcomes into each protocol's response bytes.

    ingress --Batch(jobs)--> Preprocess --Batch(+crops)--> Inference --Batch(+scores,
            +embeddings)--> Postprocess --list[Answer]--> ingress

A row of `crops` (or of `tensors`) is one image; `owners[r] = (job, image)` says whose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from engines import EngineInfo
from serve_app.errors import code_for, message_for
from serve_app.wire.request_images import buffers

NO_OWNERS = np.empty((0, 2), np.int32)


def copied(message: Any, **changes: Any) -> Any:
    """A copy of the frozen dataclass `message` with `changes`: what dataclasses.replace
    makes, without its __init__ and checks (0.6 against 3.6 us for a Job on the 2-core CPU
    machine; the hot path copies several per request). It runs no __post_init__: only for
    changes that keep the rest valid; a name that is not a field raises TypeError, as
    dataclasses.replace does."""
    if not changes.keys() <= message.__dict__.keys():
        unknown = sorted(changes.keys() - message.__dict__.keys())
        raise TypeError(f"{type(message).__name__} has no field {', '.join(unknown)}")
    copy = object.__new__(type(message))
    copy.__dict__.update(message.__dict__, **changes)
    return copy


@dataclass(frozen=True)
class Served:
    """What an ingress serves, as the group holding inference reports it."""

    name: str
    version: str
    engine: EngineInfo
    embedding_space: str  # ModelSpec.embedding_space: "" without an embedding output
    label_bytes: int = 0  # the longest label's UTF-8 bytes (bounds an answer's size)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.version}"


@dataclass(frozen=True)
class OipOutput:
    """An Open Inference Protocol output a request asked for: every class's probability,
    `k` labels, or the embedding."""

    name: str
    kind: Literal["probabilities", "labels", "embedding", "embedding_fp16"]
    k: int = 0  # labels per image (kind labels)


@dataclass(frozen=True)
class Job:
    """One request, whichever protocol it came in."""

    id: str  # request_id / OIP id, already bounded by the ingress
    # encoded images (a tuple, or spans of the request as received: request_images.py), or
    images: Sequence[bytes] = ()
    pixels: np.ndarray | None = None  # float32 (N, C, H, W) preprocessed by the client
    top_k: int = 5
    labels: bool = True  # the top_k labels per image (computed only for jobs that ask)
    scores: bool = False  # every class's probability per image
    embedding: bool = False  # the embedding per image (carried only for jobs that ask)
    embedding_fp16: bool = False  # raystream.v1: the embedding as halves (values_fp16)
    deadline: float | None = None  # time.time() past which nobody waits for the answer
    flow: str = ""  # the stream or connection it came on: flows share the decoders in turn
    protocol: str = "v1"  # "v1" or "oip": the answer's format (serve_app/wire/answers.py)
    oip_outputs: tuple[OipOutput, ...] = ()
    model: str = ""  # the model version that answers: "name/version" (empty: the default)
    count: int = -1  # images in the request; kept when a stage drops the inputs it used
    fragments: bool = False  # answer with each image's fragment too (the result cache's)
    # A traced request's W3C traceparent: the span the next stage's spans hang under
    # (serve_app/observability/tracing.py); empty when not traced.
    trace: str = ""

    def __post_init__(self) -> None:
        if self.count < 0:
            count = len(self.images) if self.pixels is None else len(self.pixels)
            object.__setattr__(self, "count", count)

    def without_inputs(self) -> Job:
        """This job once its images or pixels are used: the next stages need neither, and
        a Ray call between stages would copy them again."""
        return copied(self, images=(), pixels=None)  # `count` stays


@dataclass(frozen=True)
class StageTiming:
    preprocess_ms: float = 0.0
    queue_ms: float = 0.0  # waiting for an engine batch
    inference_ms: float = 0.0
    postprocess_ms: float = 0.0
    batch_size: int = 0  # images in the (largest) engine batch this batch's images ran in
    gpu_ms: float = 0.0  # that batch's GPU time (CUDA events; tracing on, GPU engines), else 0


@dataclass(frozen=True)
class Failure:
    code: int  # google.rpc.Code
    message: str


def fail_jobs(failures: dict[int, Failure], owners: np.ndarray, exc: Exception) -> None:
    """Every job with rows in `owners` ((job, image) pairs) fails with `exc`, unless it
    failed already."""
    failure = Failure(int(code_for(exc)), message_for(exc))
    for job in set(owners[:, 0].tolist()):
        failures.setdefault(job, failure)


# One image's part of its answer (serve_app/wire/answers.py), what the ingress' result cache keeps:
# raystream.v1: its ImageResult as a ClassifyResponse field-2 entry; OIP: its row of each
# output the request asked for.
Fragment = bytes | tuple[bytes, ...]


@dataclass(frozen=True)
class Batch:
    jobs: tuple[Job, ...]
    model: str = ""  # every job's model version, "name/version" (empty: the default model)
    # Decoded crops: uint8 (R, H, W, 3), a host array or (decode: gpu) a tensor on the GPU.
    crops: Any = None
    crop_owners: np.ndarray = field(default_factory=lambda: NO_OWNERS)
    # JPEGs left encoded for the GPU decoder of the inference stage (decode: gpu).
    jpegs: tuple[bytes, ...] = ()
    jpeg_owners: np.ndarray = field(default_factory=lambda: NO_OWNERS)
    # Images that failed, by (job, image); jobs that failed as a whole, by job.
    image_failures: dict[tuple[int, int], Failure] = field(default_factory=dict)
    job_failures: dict[int, Failure] = field(default_factory=dict)
    # Set by the inference stage, one row per image that ran (crops, then client tensors);
    # each array only if a job asked for it (rows of the other jobs are zeros):
    owners: np.ndarray = field(default_factory=lambda: NO_OWNERS)
    top_ids: np.ndarray | None = None  # int (rows, k), best first
    top_scores: np.ndarray | None = None  # float32 (rows, k): softmax probabilities
    probabilities: np.ndarray | None = None  # float32 (rows, classes) where a job asked
    embeddings: np.ndarray | None = None  # float32 (rows, D) where a job asked
    timing: StageTiming = field(default_factory=StageTiming)

    def replace(self, **changes: Any) -> Batch:
        return copied(self, **changes)  # several a call: dataclasses.replace costs ~10 us

    def nbytes(self) -> int:
        """About what this batch weighs in a message: its images, tensors and results."""
        total = sum(len(image) for job in self.jobs for image in buffers(job.images))
        total += sum(job.pixels.nbytes for job in self.jobs if job.pixels is not None)
        total += sum(len(jpeg) for jpeg in self.jpegs)
        arrays = (self.crops, self.top_ids, self.top_scores, self.probabilities, self.embeddings)
        return total + sum(array.nbytes for array in arrays if array is not None)

    def image_count(self) -> int:
        """The images of its requests (a stage replica's load:
        serve_app/transport/load_board.py)."""
        return sum(job.count for job in self.jobs)

    def live_jobs(self) -> list[int]:
        return [i for i in range(len(self.jobs)) if i not in self.job_failures]


@dataclass(frozen=True)
class Answer:
    """One job's answer: its response bytes in its protocol, and what the ingress counts."""

    payload: bytes  # empty for an OIP request that failed: its adapter reports code, message
    code: int  # the request's status code (0 OK)
    message: str = ""  # why it failed
    image_codes: tuple[tuple[int, int], ...] = ()  # (code, images) of its images
    timing: StageTiming = field(default_factory=StageTiming)
    # Where the job asked (Job.fragments): each image's Fragment, or its Failure, in order;
    # empty when the request failed as a whole.
    fragments: tuple[Fragment | Failure, ...] = ()
