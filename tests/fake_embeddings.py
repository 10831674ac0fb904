"""A stand-in for the server's stream in the tests of the embedding job's bookkeeping (shards,
resume, retries, memory at 200,000 images): `Client.stream`'s signature, and for each image a
vector that follows from its bytes, so that a test can tell that each key got its own image's
vector. The job against the real server is tested in tests/integration/test_catalog.py."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterable, AsyncIterator

import numpy as np

from raystream.v1 import classifier_pb2 as pb

INVALID_ARGUMENT, UNAVAILABLE = 3, 14
SPACE = "fake/1/sha256:0"


def vector_of(image: bytes, dim: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(image, digest_size=8).digest())
    vector = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
    return vector / np.linalg.norm(vector)


class FakeEmbeddings:
    """Images starting b"bad" fail INVALID_ARGUMENT; an image in `unavailable` is answered
    UNAVAILABLE that many times first."""

    def __init__(self, dim: int = 1280, unavailable: dict[bytes, int] | None = None) -> None:
        self.dim = dim
        self.unavailable = dict(unavailable or {})
        self.images_seen = 0
        self._results: dict[bytes, pb.ImageResult] = {}

    def _result(self, image: bytes) -> pb.ImageResult:
        if image.startswith(b"bad"):
            return pb.ImageResult(error=pb.Error(code=INVALID_ARGUMENT, message="not an image"))
        if self.unavailable.get(image, 0) > 0:
            self.unavailable[image] -= 1
            return pb.ImageResult(error=pb.Error(code=UNAVAILABLE, message="restarting"))
        if image not in self._results:
            values = vector_of(image, self.dim)
            self._results[image] = pb.ImageResult(embedding=pb.Embedding(values=values))
        return self._results[image]

    async def stream(
        self, requests: AsyncIterable[pb.ClassifyRequest]
    ) -> AsyncIterator[pb.ClassifyResponse]:
        async for request in requests:
            assert list(request.outputs) == [pb.EMBEDDING]
            self.images_seen += len(request.images)
            results = [self._result(image) for image in request.images]
            yield pb.ClassifyResponse(request_id=request.request_id, results=results)
