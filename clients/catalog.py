"""The catalog workflow in Python: embed a catalog into sharded Parquet files (resumable),
build a nearest-neighbour index over them, and ask for the items most like an image.

    from clients.catalog import embed_catalog, build_index, similar

    summary = embed_catalog("photos/", "vectors/", server="127.0.0.1:9000")
    build_index("vectors/", "catalog.index")
    for n in similar("catalog.index", "new-photo.jpg", k=10, server="127.0.0.1:9000"):
        print(n.key, n.score)

`embed_catalog` is `raystream embed --out FOLDER`, `build_index` is `raystream index build`,
`similar` is `raystream similar --index`; the async forms (`aembed_catalog`, `asimilar`) are for
code already inside an event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from clients.catalog_inputs import CatalogInputs
from clients.embed_job import EmbedJob
from clients.embed_senders import SenderPool
from clients.shard_store import JobIdentity, OutputError, ShardStore, read_state, shard_paths
from clients.vector_index import IndexMeta, Neighbour, VectorIndex
from clients.vector_index import build_index as _build_index

logger = logging.getLogger(__name__)

__all__ = [
    "EmbedSummary",
    "aembed_catalog",
    "asimilar",
    "build_index",
    "embed_catalog",
    "similar",
]

# Requests of 16 images, 64 of them outstanding per connection (what the server admits on one
# stream, limits.max_in_flight_per_stream): images/s is at most the images in flight over the
# latency, and a GPU server answers a saturated connection in about 40 ms, so 16 requests
# in flight held one process to 0.44x of the GPU config's saturated figure.
DEFAULT_BATCH = 16
DEFAULT_IN_FLIGHT = 64


@dataclass(frozen=True)
class EmbedSummary:
    out: Path
    images: int  # in the inputs
    vectors: int  # in the shards, this run and earlier ones
    failures: int  # in the failures file
    embedded_now: int  # this run
    failed_now: int
    model: str
    version: str
    embedding_space: str
    dim: int

    @property
    def complete(self) -> bool:
        return self.vectors + self.failures >= self.images


def _as_inputs(inputs: CatalogInputs | str | Path | Sequence[str | Path]) -> CatalogInputs:
    if isinstance(inputs, CatalogInputs):
        return inputs
    from engines.calibration import IMAGE_SUFFIXES

    paths = [inputs] if isinstance(inputs, str | Path) else list(inputs)
    return CatalogInputs(paths, image_suffixes=IMAGE_SUFFIXES)


async def embedding_model(client, model: str):
    """What serves `model`, which must have an embedding output."""
    info = await client.model_info(model)
    if not info.embedding_dim:
        raise OutputError(
            f"the model served at {client.address} ({info.name} version {info.version}) has "
            f"no embedding output; export a new version with `raystream export` and serve it"
        )
    return info


async def aembed_catalog(
    inputs: CatalogInputs | str | Path | Sequence[str | Path],
    out: str | Path,
    *,
    server: str = "127.0.0.1:9000",
    model: str = "",
    batch_size: int = DEFAULT_BATCH,
    in_flight: int | None = None,
    connections: int = 1,
    shard_rows: int = 50_000,
    row_group_rows: int = 10_000,
    attempts: int = 5,
    commit_seconds: float = 300.0,
    dtype: str = "float32",
    senders: int = 1,
    progress: bool | Callable[[int], None] = False,
    client_options: dict | None = None,
) -> EmbedSummary:
    """Embeds every image of `inputs` into the output folder `out`, or goes on with the job
    already there (the same inputs and embedding space, else OutputError). `model`: empty
    for the model the existing output was made with, else the server's default. `in_flight`:
    requests outstanding (default 64 per connection opened). `progress`: a tqdm bar on
    stderr, or a callable told of each image done. `dtype`: "float16" stores half the bytes
    (each vector rounded from the server's float32; cosine to it >= 0.9999). `senders`:
    above 1, that many child processes send the images, each with `connections` connections
    and `in_flight` requests of its own (clients/embed_senders.py), for a server that answers
    faster than one process can send."""
    from clients.client import Client

    out = Path(out)
    inputs = _as_inputs(inputs)
    scan = inputs.scan()
    previous = read_state(out)
    if not model and previous is not None:
        model = f"{previous[0].model}/{previous[0].version}"
    async with Client(server, connections=connections, **(client_options or {})) as client:
        try:
            info = await embedding_model(client, model)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND or previous is None:
                raise
            raise OutputError(
                f"{out} holds vectors of {model}, which the server at {server} does not serve "
                f"({exc.details()}): serve it to go on, or give another --out"
            ) from None
        job = JobIdentity(
            inputs_fingerprint=scan.fingerprint,
            images=scan.count,
            model=info.name,
            version=info.version,
            embedding_space=info.embedding_space,
            dim=info.embedding_dim,
            dtype=dtype,
        )
        store = ShardStore(out, job, shard_rows=shard_rows, row_group_rows=row_group_rows)
        bar = None
        if progress is True:
            from tqdm import tqdm

            bar = tqdm(total=scan.count, initial=store.done, unit="img", file=sys.stderr)
            on_progress = bar.update
        else:
            on_progress = progress or (lambda n: None)
        # every vector from the version named in the output, even if another loads meanwhile
        pinned = f"{info.name}/{info.version}"
        listed = inputs.as_scanned(scan)  # the list again, as it is sent: checked
        if senders > 1:
            run = SenderPool(
                store,
                listed,
                senders,
                {
                    "server": server,
                    "model": pinned,
                    "batch_size": batch_size,
                    "in_flight": in_flight or DEFAULT_IN_FLIGHT * connections,
                    "attempts": attempts,
                    "fp16": dtype == "float16",
                    "connections": connections,
                    "client_options": client_options or {},
                },
                commit_seconds=commit_seconds,
                on_progress=on_progress,
            )
            start = run.run
        else:
            run = EmbedJob(
                store,
                listed,
                model=pinned,
                batch_size=batch_size,
                in_flight=in_flight or DEFAULT_IN_FLIGHT * client.connections,
                attempts=attempts,
                commit_seconds=commit_seconds,
                on_progress=on_progress,
                fp16=dtype == "float16",
            )
            start = functools.partial(run.run, client.stream)
        try:
            if not store.complete:
                await start()
                listed.check()
                if not store.complete:  # a sender gone, its failure its own task's
                    raise OutputError(
                        f"the job ended with {scan.count - store.done} images neither "
                        f"embedded nor failed; run the same command again to go on"
                    )
        finally:
            store.close()
            if bar is not None:
                bar.close()
    committed = store.committed
    return EmbedSummary(
        out=out,
        images=scan.count,
        vectors=committed.vectors,
        failures=committed.failures,
        embedded_now=run.embedded,
        failed_now=run.failed,
        model=info.name,
        version=info.version,
        embedding_space=info.embedding_space,
        dim=info.embedding_dim,
    )


def embed_catalog(inputs, out, **options) -> EmbedSummary:
    """`aembed_catalog` in an event loop of its own."""
    return asyncio.run(aembed_catalog(inputs, out, **options))


def build_index(
    vectors: str | Path, out: str | Path, *, kind: str | None = None, nprobe: int | None = None
) -> IndexMeta:
    """A FAISS index (folder `out`) over the shards of output folder `vectors`."""
    options = {"nprobe": nprobe} if nprobe else {}
    return _build_index(shard_paths(Path(vectors)), Path(out), kind=kind, **options)


async def asimilar(
    index: str | Path | VectorIndex,
    image: str | Path | bytes,
    *,
    k: int = 10,
    server: str = "127.0.0.1:9000",
    model: str = "",
    client_options: dict | None = None,
) -> list[Neighbour]:
    """The k items of `index` most like `image`, embedded by the server with the index's
    model version (or `model`), best first."""
    from clients.client import Client

    opened = index if isinstance(index, VectorIndex) else VectorIndex(Path(index))
    meta = opened.meta
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    async with Client(server, **(client_options or {})) as client:
        try:
            info = await embedding_model(client, model or f"{meta.model}/{meta.version}")
        except grpc.aio.AioRpcError as exc:
            if model or exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            info = await embedding_model(client, "")  # the default: refused below if its
            # embedding space is not the index's
        pinned = f"{info.name}/{info.version}"
        (result,) = [r async for r in client.embed([("query", data)], model=pinned)]
    if not result.ok:
        from clients.client import status_name

        code = status_name(result.error_code)
        raise OutputError(f"the query image failed: {code}: {result.error}")
    return opened.search(result.vector, k, embedding_space=info.embedding_space)


def similar(index, image, **options) -> list[Neighbour]:
    """`asimilar` in an event loop of its own."""
    return asyncio.run(asimilar(index, image, **options))
