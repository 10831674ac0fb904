"""The embedding job: every image of a catalog over one stream (spread over the client's
connections), its vector into a ShardStore as it arrives, resumable.

Requests of `batch_size` images, `in_flight` of them outstanding. An image answered UNAVAILABLE
or RESOURCE_EXHAUSTED (the server restarting, or shedding load) goes back in line after a
backoff (0.5 s, doubling, at most 30 s), up to `attempts` times; then, or on any other error,
it is listed in the failures file and not tried again. A stream that fails as a whole
(the server gone) is opened again after the same backoff; after `attempts` streams in a row
that answered no image, the job stops, its work committed: the same command goes on later.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import grpc

from clients.catalog_errors import CatalogError
from clients.catalog_inputs import CatalogItem
from clients.client import vector_of
from clients.shard_store import ShardStore
from clients.spread import as_async
from raystream.v1 import classifier_pb2 as pb

logger = logging.getLogger(__name__)

RETRIED = frozenset(
    code.value[0] for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
)
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0

StreamFn = Callable[[AsyncIterable[pb.ClassifyRequest]], AsyncIterator[pb.ClassifyResponse]]


class ServerGone(CatalogError):
    """The server could not be reached for `attempts` streams in a row."""


@dataclass
class _Pending:
    item: CatalogItem
    attempts: int = 0  # sent so far


async def _not_done(
    items: Iterable[CatalogItem] | AsyncIterable[CatalogItem], store: ShardStore
) -> AsyncIterator[CatalogItem]:
    """The items (a list read here, or handed out by another process) not yet in `store`."""
    async for item in as_async(items):
        if not store.is_done(item.ordinal):
            yield item


def backoff(attempt: int) -> float:
    """Seconds before try number `attempt` + 1."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (attempt - 1))


def _code_name(code: int) -> str:
    return next((s.name for s in grpc.StatusCode if s.value[0] == code), str(code))


class EmbedJob:
    def __init__(
        self,
        store: ShardStore,
        items: Iterable[CatalogItem] | AsyncIterable[CatalogItem],
        *,
        model: str,
        batch_size: int = 16,
        in_flight: int = 16,
        attempts: int = 5,
        commit_seconds: float = 300.0,
        on_progress: Callable[[int], None] = lambda n: None,
        fp16: bool = False,
    ) -> None:
        """`fp16`: the server sends each vector as halves (half the bytes on the wire)."""
        self._store = store
        self._dtype = pb.FLOAT16 if fp16 else pb.FLOAT32
        self._source = _not_done(items, store)
        # the source's next images, read ahead by a task of run()'s own: a stream that fails
        # while the job waits for images then holds none of them (None: the source ended)
        self._fresh: asyncio.Queue[CatalogItem | None] = asyncio.Queue(4 * batch_size)
        self._source_ended = False
        self._source_error: Exception | None = None
        self._model = model
        self._batch_size = batch_size
        self._in_flight = in_flight
        self._attempts = attempts
        self._commit_seconds = commit_seconds
        self._on_progress = on_progress
        self._retries: list[tuple[float, int, _Pending]] = []  # (due, ordinal, pending): a heap
        self._ids = itertools.count()
        self.embedded = 0
        self.failed = 0

    async def run(self, stream: StreamFn) -> None:
        """Until every image is embedded or failed; commits as it goes and at the end."""
        reading = asyncio.ensure_future(self._read_ahead())
        try:
            await self._streams(stream)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        if self._source_error is not None:
            raise self._source_error  # what was read before it is done and committed

    async def _read_ahead(self) -> None:
        try:
            async for item in self._source:
                await self._fresh.put(item)
        except Exception as exc:  # the list could not be read on: run() raises it
            self._source_error = exc
        await self._fresh.put(None)

    async def _streams(self, stream: StreamFn) -> None:
        streams_failed = 0  # in a row, none of them answering an image
        while True:
            before = self.embedded + self.failed
            try:
                await self._one_stream(stream)
            except grpc.aio.AioRpcError as exc:
                if exc.code().value[0] not in RETRIED:
                    self._store.commit()
                    raise
                progressed = self.embedded + self.failed > before
                streams_failed = 1 if progressed else streams_failed + 1
                self._store.commit()
                if streams_failed >= self._attempts:
                    raise ServerGone(
                        f"the server failed {streams_failed} streams in a row "
                        f"({exc.code().name}: {exc.details()}); what was embedded is "
                        f"committed: run the same command again to go on"
                    ) from None
                pause = backoff(streams_failed)
                logger.warning("stream failed (%s); again in %.1f s", exc.code().name, pause)
                await asyncio.sleep(pause)
                continue
            if not self._retries:
                break
        self._store.commit()

    async def _one_stream(self, stream: StreamFn) -> None:
        """Until the stream ends: every image sent and answered, or the stream failed."""
        pending: dict[str, list[_Pending]] = {}
        slots = asyncio.Semaphore(self._in_flight)
        changed = asyncio.Event()  # a response came: retries may be due, or the end near

        async def requests() -> AsyncIterator[pb.ClassifyRequest]:
            while True:
                await slots.acquire()  # before taking images: a closed stream strands none
                chunk = await self._next_chunk()
                if not chunk:
                    slots.release()
                    if not self._retries and not pending:
                        return
                    wait = self._retries[0][0] - time.monotonic() if self._retries else None
                    changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), wait)
                    continue
                sent, images = [], []
                for p in chunk:
                    try:
                        with open(p.item.path, "rb") as image:
                            images.append(image.read())
                    except OSError as exc:
                        self._fail(p, "NOT_FOUND", f"cannot read the file: {exc.strerror or exc}")
                        continue
                    p.attempts += 1
                    sent.append(p)
                if not sent:
                    slots.release()
                    continue
                request_id = str(next(self._ids))
                pending[request_id] = sent
                yield pb.ClassifyRequest(
                    request_id=request_id,
                    images=images,
                    model=self._model,
                    outputs=[pb.EMBEDDING],
                    embedding_dtype=self._dtype,
                )

        try:
            await self._receive(stream(requests()), pending, slots, changed)
        finally:
            for sent in pending.values():  # unanswered by a stream that broke: in line again
                for p in sent:
                    heapq.heappush(self._retries, (time.monotonic(), p.item.ordinal, p))

    async def _receive(
        self,
        responses: AsyncIterator[pb.ClassifyResponse],
        pending: dict[str, list[_Pending]],
        slots: asyncio.Semaphore,
        changed: asyncio.Event,
    ) -> None:
        async for response in responses:
            slots.release()
            sent = pending.pop(response.request_id)
            if response.error.code:
                for p in sent:
                    self._answer(p, response.error.code, response.error.message, None)
            else:
                for p, result in zip(sent, response.results, strict=True):
                    self._answer(p, result.error.code, result.error.message, result)
            changed.set()
            if self._store.seconds_open >= self._commit_seconds:
                self._store.commit()

    async def _next_chunk(self) -> list[_Pending]:
        """Up to batch_size images: retries that are due, then fresh ones. It waits only
        while it holds none (a stream cancelled meanwhile loses nothing): for a fresh image,
        or until the first retry is due. Empty where the source ended and no retry is due."""
        chunk: list[_Pending] = []
        now = time.monotonic()
        while self._retries and self._retries[0][0] <= now and len(chunk) < self._batch_size:
            chunk.append(heapq.heappop(self._retries)[2])
        while len(chunk) < self._batch_size and not self._source_ended:
            if chunk:
                if self._fresh.empty():
                    break  # send what it has
                item = self._fresh.get_nowait()
            else:
                due = self._retries[0][0] - time.monotonic() if self._retries else None
                try:
                    item = await asyncio.wait_for(self._fresh.get(), due)
                except TimeoutError:
                    break  # a retry is due
            if item is None:
                self._source_ended = True
            else:
                chunk.append(_Pending(item))
        return chunk

    def _answer(self, p: _Pending, code: int, message: str, result: pb.ImageResult | None) -> None:
        if code == 0:
            vector = vector_of(result.embedding)
            self._store.add(p.item.ordinal, p.item.key, vector)
            self.embedded += 1
            self._on_progress(1)
        elif code in RETRIED and p.attempts < self._attempts:
            due = time.monotonic() + backoff(p.attempts)
            heapq.heappush(self._retries, (due, p.item.ordinal, p))
        else:
            tries = f" (after {p.attempts} tries)" if code in RETRIED else ""
            self._fail(p, _code_name(code), message + tries)

    def _fail(self, p: _Pending, code: str, message: str) -> None:
        self._store.fail(p.item.ordinal, p.item.key, p.item.path, code, message)
        self.failed += 1
        self._on_progress(1)
