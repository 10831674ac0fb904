"""`raystream embed`, `raystream similar` and `raystream index build`: image embeddings into
an output folder of Parquet shards (clients/catalog.py: resumable, in bounded memory) or one
vector file, an index over the shards, and the nearest neighbours of an image.

The one vector file (--out ending .parquet or .npy) holds every vector in memory until the
end: for small sets. An output folder is written as the vectors arrive and a killed job goes
on where it stopped (clients/shard_store.py).

A vector file holds a row per image: `key` (the image's path), `vector` (float32, norm 1),
`model`, `version` and `embedding_space` (vectors compare only within one space). Parquet
(through pyarrow, `pip install 'raystream[parquet]'`) or NumPy's .npy: a structured array
with the same fields, read with `np.load(path)`.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMATS = ("parquet", "npy")
FIELDS = ("key", "vector", "model", "version", "embedding_space")


class EmbedError(Exception):
    """An expected failure of embed or similar: printed as one line, exit code 2."""


@dataclass(frozen=True)
class Vectors:
    """The rows of a vector file."""

    keys: list[str]
    vectors: np.ndarray  # float32 (N, D), each row of norm 1
    model: list[str]
    version: list[str]
    embedding_space: list[str]


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise EmbedError(
            "Parquet files need pyarrow: pip install 'raystream[parquet]', or use --format npy"
        ) from None
    return pa, pq


def file_format(path: Path, chosen: str | None = None) -> str:
    """`chosen`, else the one the suffix names (.npy), else parquet."""
    return chosen or ("npy" if path.suffix.lower() == ".npy" else "parquet")


def write_vectors(rows: Vectors, path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pa, pq = _pyarrow()
        dim = rows.vectors.shape[1]
        flat = pa.array(rows.vectors.reshape(-1), pa.float32())
        table = pa.table(
            {
                "key": pa.array(rows.keys, pa.string()),
                "vector": pa.FixedSizeListArray.from_arrays(flat, dim),
                "model": pa.array(rows.model, pa.string()),
                "version": pa.array(rows.version, pa.string()),
                "embedding_space": pa.array(rows.embedding_space, pa.string()),
            }
        )
        pq.write_table(table, path)
        return
    texts = {
        "key": rows.keys,
        "model": rows.model,
        "version": rows.version,
        "embedding_space": rows.embedding_space,
    }
    dtype = [(name, f"U{max(map(len, values), default=1) or 1}") for name, values in texts.items()]
    dtype.insert(1, ("vector", "<f4", (rows.vectors.shape[1],)))
    data = np.empty(len(rows.keys), dtype)
    for name, values in texts.items():
        data[name] = values
    data["vector"] = rows.vectors
    with path.open("wb") as f:  # np.save on a path would add .npy to any other suffix
        np.save(f, data)


def read_vectors(path: Path) -> Vectors:
    if not path.is_file():
        raise EmbedError(f"{path}: no such file (make it with `raystream embed`)")
    try:
        if file_format(path) == "npy":
            data = np.load(path)
            columns = {name: data[name] for name in FIELDS}
        else:
            _, pq = _pyarrow()
            table = pq.read_table(path, columns=list(FIELDS))
            columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in FIELDS}
        count = len(columns["key"])
        vectors = np.stack(columns["vector"]) if count else np.zeros((0, 0))
    except (ValueError, KeyError, OSError) as exc:
        raise EmbedError(f"{path} is not a vector file of `raystream embed`: {exc}") from None
    return Vectors(
        keys=[str(key) for key in columns["key"]],
        vectors=vectors.astype(np.float32, copy=False),
        model=[str(m) for m in columns["model"]],
        version=[str(v) for v in columns["version"]],
        embedding_space=[str(e) for e in columns["embedding_space"]],
    )


def nearest(vectors: np.ndarray, query: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k rows most similar to `query` by cosine (rows and query of norm 1), best first:
    (row, cosine)."""
    scores = vectors @ query
    k = min(k, len(scores))
    rows = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    rows = rows[np.argsort(-scores[rows], kind="stable")]
    return [(int(row), float(scores[row])) for row in rows]


async def _index_model(client, index: Vectors) -> str:
    """The index's model version ("name/version") where it holds one and the server serves
    it (the query is then embedded in the index's space); else "" (the default model)."""
    import grpc

    versions = set(zip(index.model, index.version, strict=True))
    if len(versions) != 1:
        return ""
    model = "/".join(versions.pop())
    try:
        await client.model_info(model)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return ""
    return model


def writes_one_file(out: Path) -> bool:
    """Whether --out names one vector file (.parquet, .npy), not an output folder."""
    return out.suffix.lower() in (".parquet", ".npy") and not out.is_dir()


def reuse_freed_memory() -> None:
    """Let this process keep and reuse the memory it frees. With glibc's defaults, once the
    job had written its first row group, the memory it freed went back to the kernel and
    faulted in again for every request: 33 page faults an image, half the job's CPU. Here
    blocks up to 32 MiB come from the heap, which keeps up to 256 MiB free before it trims:
    1.8-1.9x the images/s against a server that answers at once, for 50 MB more at the peak.
    Nothing where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 256 << 20)


async def embed_to_folder(args: argparse.Namespace, inputs, connection: dict) -> int:
    """Embeds `inputs` into the output folder args.out, or goes on with the job there."""
    from clients.catalog import aembed_catalog
    from clients.shard_store import FAILURES

    _pyarrow()
    reuse_freed_memory()
    summary = await aembed_catalog(
        inputs,
        args.out,
        server=args.server,
        model=args.model,
        batch_size=args.batch_size,
        in_flight=args.in_flight,
        connections=args.connections,
        shard_rows=args.shard_rows,
        row_group_rows=args.row_group_rows,
        attempts=args.attempts,
        dtype=args.dtype,
        senders=args.senders,
        progress=sys.stderr.isatty(),
        client_options={"timeout": args.timeout, **connection},
    )
    print(
        f"{summary.vectors} vectors of {summary.dim} floats ({args.dtype}; {summary.model} version "
        f"{summary.version}, embedding space {summary.embedding_space}) in {summary.out}; "
        f"{summary.embedded_now} embedded by this run"
        + (
            f"; {summary.failures} images failed, listed in {summary.out / FAILURES}"
            if summary.failures
            else ""
        )
    )
    return 1 if summary.failures else 0


async def index_build(args: argparse.Namespace) -> int:
    from clients.catalog import build_index

    meta = build_index(args.vectors, args.out, kind=args.kind, nprobe=args.nprobe)
    print(
        f"indexed {meta.count} vectors of {meta.dim} floats ({meta.kind}, embedding space "
        f"{meta.embedding_space}) in {args.out}"
    )
    return 0


async def embed(args: argparse.Namespace, paths: list[Path], connection: dict) -> int:
    """Embeds `paths` over one stream into the vector file args.out; a line per image that
    failed."""
    from tqdm import tqdm

    from clients.catalog import embedding_model
    from clients.client import Client, status_name

    fmt = file_format(args.out, args.format)
    if fmt == "parquet":
        _pyarrow()  # before any work: fail now if it cannot be written
    progress = tqdm(total=len(paths), unit="img", disable=not sys.stderr.isatty(), file=sys.stderr)
    good, failed = {}, []
    async with Client(
        args.server, connections=args.connections, timeout=args.timeout, **connection
    ) as client:
        info = await embedding_model(client, args.model)
        # every vector from the version named in the file, even if another is loaded meanwhile
        pinned = f"{info.name}/{info.version}"
        async for result in client.embed(paths, batch_size=args.batch_size, model=pinned):
            progress.update(1)
            if result.ok:
                good[str(result.key)] = result.vector
            else:
                failed.append((str(result.key), status_name(result.error_code), result.error))
    progress.close()
    width = max((len(key) for key, _, _ in failed), default=0)
    for key, code, message in sorted(failed):
        print(f"{key:<{width}}  ERROR {code}: {message}")
    if good:
        keys = sorted(good)
        n = len(keys)
        rows = Vectors(
            keys=keys,
            vectors=np.stack([good[key] for key in keys]),
            model=[info.name] * n,
            version=[info.version] * n,
            embedding_space=[info.embedding_space] * n,
        )
        write_vectors(rows, args.out, fmt)
        print(
            f"wrote {n} vectors of {info.embedding_dim} floats ({info.name} version "
            f"{info.version}, embedding space {info.embedding_space}) to {args.out}"
            + (f"; {len(failed)} images failed" if failed else "")
        )
    else:
        print(f"no image could be embedded; {args.out} not written")
    return 1 if failed else 0


async def similar(args: argparse.Namespace, connection: dict) -> int:
    """Prints the args.k nearest neighbours of args.query in the index, by cosine."""
    from clients.catalog import embedding_model
    from clients.client import Client, status_name
    from clients.vector_index import META_FILE

    if (args.index / META_FILE).is_file():
        return await _similar_in_index(args, connection)
    if args.index.is_dir():
        raise EmbedError(
            f"{args.index} is not an index: build one over an output folder of `raystream "
            f"embed` with `raystream index build {args.index} --out INDEX`"
        )
    index = read_vectors(args.index)
    if not index.keys:
        raise EmbedError(f"{args.index} holds no vectors")
    query = Path(args.query)
    if not query.is_file():
        raise EmbedError(f"{query}: no such file")
    async with Client(args.server, timeout=args.timeout, **connection) as client:
        model = args.model or await _index_model(client, index)
        info = await embedding_model(client, model)
        pinned = f"{info.name}/{info.version}"
        (result,) = [r async for r in client.embed([query], model=pinned)]
    if not result.ok:
        raise EmbedError(f"{query}: {status_name(result.error_code)}: {result.error}")
    same = np.array([space == info.embedding_space for space in index.embedding_space])
    if not same.any():
        raise EmbedError(
            f"{args.index} holds vectors of embedding space {index.embedding_space[0]}, the "
            f"server embeds in {info.embedding_space}: they do not compare; embed the images "
            f"again with this server"
        )
    rows = np.flatnonzero(same)
    found = nearest(index.vectors[rows], result.vector, args.k)
    width = max(len(index.keys[rows[row]]) for row, _ in found)
    print(f"{'rank':>4}  {'cosine':>7}  {'key':<{width}}")
    for rank, (row, cosine) in enumerate(found, 1):
        print(f"{rank:>4}  {cosine:>7.4f}  {index.keys[rows[row]]}")
    skipped = len(index.keys) - len(rows)
    if skipped:
        print(f"({skipped} vectors of other embedding spaces skipped)", file=sys.stderr)
    return 0


async def _similar_in_index(args: argparse.Namespace, connection: dict) -> int:
    from clients.catalog import asimilar

    query = Path(args.query)
    if not query.is_file():
        raise EmbedError(f"{query}: no such file")
    found = await asimilar(
        args.index,
        query,
        k=args.k,
        server=args.server,
        model=args.model,
        client_options={"timeout": args.timeout, **connection},
    )
    width = max((len(n.key) for n in found), default=3)
    print(f"{'rank':>4}  {'cosine':>7}  {'key':<{width}}")
    for rank, n in enumerate(found, 1):
        print(f"{rank:>4}  {n.score:>7.4f}  {n.key}")
    return 0
