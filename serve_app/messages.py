"""Messages between the pipeline's stages: small frozen dataclasses, never bare tuples. The
two made per image and label (ImageOutcome, Label: 8 to 48 of them for a request of 8) are
NamedTuples, which cost half as much to make (0.45 us against 0.85-1.3 us) and read the same.

Ingress --images--> Preprocess --Preprocessed--> Inference --Inferred--> Postprocess
        <-------------------------------- Classified --------------------------------
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class ImageFailure:
    index: int  # position of the image in its request
    code: int  # google.rpc.Code
    message: str


@dataclass(frozen=True)
class StageTiming:
    preprocess_ms: float = 0.0
    queue_ms: float = 0.0  # waiting in the inference deployment's batch queue
    inference_ms: float = 0.0
    postprocess_ms: float = 0.0
    batch_size: int = 0  # images in the engine batch this request ran in


@dataclass(frozen=True)
class Preprocessed:
    """One request's images, decoded: the good ones as pixels, the bad ones as failures."""

    count: int  # images in the request
    # uint8 (len(indices), H, W, 3) crops; or, from a client that preprocessed them itself
    # (Open Inference Protocol), float32 (len(indices), 3, H, W) as the model takes them.
    # In a GPU inference replica after decode: gpu, the crops are a torch tensor on the GPU
    # (never sent over Ray).
    pixels: np.ndarray
    indices: tuple[int, ...]  # request position of each row of `pixels`
    failures: tuple[ImageFailure, ...]
    timing: StageTiming = field(default_factory=StageTiming)
    # decode: gpu: JPEGs whose headers passed the checks, still encoded, and their positions
    jpegs: tuple[bytes, ...] = ()
    jpeg_indices: tuple[int, ...] = ()
    # time.time() after which nobody waits for the answer: the engine skips the request
    deadline: float | None = None


@dataclass(frozen=True)
class Inferred:
    count: int
    logits: np.ndarray  # float32 (len(indices), num_classes)
    indices: tuple[int, ...]
    failures: tuple[ImageFailure, ...]
    timing: StageTiming


class Label(NamedTuple):
    class_id: int
    name: str
    score: float  # softmax probability


class ImageOutcome(NamedTuple):
    labels: tuple[Label, ...] = ()
    failure: ImageFailure | None = None
    # float32 (num_classes,): every class's probability, when the request asked for them
    # (the Open Inference Protocol's default output); a row, not num_classes Labels
    scores: np.ndarray | None = None


@dataclass(frozen=True)
class Classified:
    outcomes: tuple[ImageOutcome, ...]  # outcomes[i] answers images[i]
    timing: StageTiming
