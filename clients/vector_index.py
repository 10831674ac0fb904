"""A nearest-neighbour index over the shards of `raystream embed`, through FAISS
(`pip install 'raystream[index]'`), and the exact search it is measured against.

An index is a folder:

    index/
      index.faiss     the FAISS index (inner product: the vectors have norm 1, so cosine)
      keys.parquet    the key of each row, in the index's row order
      index.json      model, version, embedding space, dim, count, the index's kind

The embedding space is kept in index.json, and an index refuses vectors or queries of
another one. The kind: exact ("Flat") below `EXACT_BELOW` vectors, where scanning them all
costs under a millisecond or two; above, an inverted file of scalar-quantised vectors
("IVF{lists},SQ8": a byte per dimension, a quarter of float32's memory), its coarse centroids
trained on a sample of up to 100,000 vectors, searched with `nprobe` lists of the ~4*sqrt(N).
The shards are read a row group at a time: building holds the index and one row group, not
the vectors.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from clients.catalog_errors import CatalogError

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
KEYS_FILE = "keys.parquet"
META_FILE = "index.json"
EXACT_BELOW = 50_000
TRAIN_SAMPLE = 100_000
DEFAULT_NPROBE = 32


class VectorIndexError(CatalogError):
    """An index cannot be built or used as asked: one line for the user."""


@dataclass(frozen=True)
class IndexMeta:
    model: str
    version: str
    embedding_space: str
    dim: int
    count: int
    kind: str  # the FAISS factory string
    nprobe: int = DEFAULT_NPROBE


@dataclass(frozen=True)
class Neighbour:
    key: str
    score: float  # cosine


def _faiss():
    try:
        import faiss
    except ImportError:
        raise VectorIndexError("an index needs FAISS: pip install 'raystream[index]'") from None
    return faiss


def kind_for(count: int) -> str:
    """The FAISS factory string for `count` vectors."""
    if count < EXACT_BELOW:
        return "Flat"
    lists = 1 << round(math.log2(4 * math.sqrt(count)))
    return f"IVF{lists},SQ8"


# -- reading shards -------------------------------------------------------------------------------


def _shard_batches(shards: Sequence[Path]) -> Iterator[tuple[list[str], np.ndarray, dict]]:
    """(keys, float32 vectors, the shard's raystream metadata) a row group at a time."""
    import pyarrow.parquet as pq

    for shard in shards:
        f = pq.ParquetFile(shard)
        metadata = {
            k.decode().removeprefix("raystream."): v.decode()
            for k, v in (f.schema_arrow.metadata or {}).items()
            if k.startswith(b"raystream.")
        }
        for group in range(f.num_row_groups):
            table = f.read_row_group(group, columns=["key", "vector", "embedding_space"])
            vector = table.column("vector").combine_chunks()
            dim = vector.type.list_size
            values = vector.flatten().to_numpy(zero_copy_only=False)
            vectors = values.reshape(-1, dim).astype(np.float32, copy=False)
            spaces = set(table.column("embedding_space").to_pylist())
            yield table.column("key").to_pylist(), vectors, {**metadata, "spaces": spaces}


def _space_of(metadata: dict, shard: str) -> str:
    if len(metadata["spaces"]) != 1:
        raise VectorIndexError(f"{shard} holds vectors of several embedding spaces")
    return next(iter(metadata["spaces"]))


def build_index(
    shards: Sequence[Path],
    out: Path,
    *,
    kind: str | None = None,
    nprobe: int = DEFAULT_NPROBE,
    threads: int | None = None,
) -> IndexMeta:
    """An index over `shards` (Parquet files of `raystream embed`, all of one embedding
    space) in folder `out`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    faiss = _faiss()
    if threads:
        faiss.omp_set_num_threads(threads)
    if not shards:
        raise VectorIndexError("no shards to index")
    count, first = 0, None
    for shard in shards:
        metadata = pq.ParquetFile(shard).metadata
        count += metadata.num_rows
    for _keys, vectors, metadata in _shard_batches(shards[:1]):
        first = metadata, vectors.shape[1]
        break
    if first is None:
        raise VectorIndexError(f"{shards[0]} holds no vectors")
    metadata, dim = first
    space = _space_of(metadata, str(shards[0]))
    kind = kind or kind_for(count)
    index = new_index(dim, kind, lambda: _training_sample(shards, count, dim))
    out.mkdir(parents=True, exist_ok=True)
    temporary_keys = out / f".{KEYS_FILE}.tmp"
    schema = pa.schema([("key", pa.string())])
    with pq.ParquetWriter(temporary_keys, schema) as keys_out:
        for shard in shards:
            for keys, vectors, batch_metadata in _shard_batches([shard]):
                found = _space_of(batch_metadata, str(shard))
                if found != space or vectors.shape[1] != dim:
                    raise VectorIndexError(
                        f"{shard} holds vectors of embedding space {found}, the index "
                        f"{space}: they do not compare; index each space on its own"
                    )
                index.add(vectors)
                keys_out.write_table(pa.table({"key": pa.array(keys, pa.string())}))
    faiss.write_index(index, str(out / f".{INDEX_FILE}.tmp"))
    meta = IndexMeta(
        model=metadata.get("model", ""),
        version=metadata.get("version", ""),
        embedding_space=space,
        dim=dim,
        count=index.ntotal,
        kind=kind,
        nprobe=nprobe,
    )
    temporary_keys.replace(out / KEYS_FILE)
    (out / f".{INDEX_FILE}.tmp").replace(out / INDEX_FILE)
    (out / META_FILE).write_text(json.dumps(asdict(meta), indent=1))
    logger.info("indexed %d vectors (%s) in %s", index.ntotal, kind, out)
    return meta


def new_index(dim: int, kind: str, sample: Callable[[], np.ndarray]):
    """An empty FAISS index of `kind` over inner products, trained on `sample()` where it
    needs training."""
    faiss = _faiss()
    index = faiss.index_factory(dim, kind, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(sample())
    return index


def set_nprobe(index, nprobe: int) -> None:
    """Lists searched per query, where the index has lists."""
    faiss = _faiss()
    lists = faiss.try_extract_index_ivf(index)
    if lists is not None:
        lists.nprobe = nprobe


def _training_sample(shards: Sequence[Path], count: int, dim: int) -> np.ndarray:
    """Up to TRAIN_SAMPLE vectors spread over all the shards (every k-th row)."""
    step = max(1, count // TRAIN_SAMPLE)
    sample = np.empty((min(count, TRAIN_SAMPLE), dim), np.float32)
    taken, row = 0, 0
    for _keys, vectors, _ in _shard_batches(shards):
        picked = vectors[(-row) % step :: step][: len(sample) - taken]
        sample[taken : taken + len(picked)] = picked
        taken += len(picked)
        row += len(vectors)
        if taken == len(sample):
            break
    return sample[:taken]


class VectorIndex:
    """An index folder, opened for search."""

    def __init__(self, folder: Path) -> None:
        import pyarrow.parquet as pq

        faiss = _faiss()
        if not (folder / META_FILE).is_file():
            raise VectorIndexError(
                f"{folder}: not an index of `raystream index build` (no {META_FILE})"
            )
        self.folder = folder
        self.meta = IndexMeta(**json.loads((folder / META_FILE).read_text()))
        self._index = faiss.read_index(str(folder / INDEX_FILE))
        set_nprobe(self._index, self.meta.nprobe)
        self._keys = pq.read_table(folder / KEYS_FILE).column("key").to_numpy(zero_copy_only=False)

    def search(self, query: np.ndarray, k: int, *, embedding_space: str) -> list[Neighbour]:
        """The k rows most like `query` (norm 1, of `embedding_space`), best first."""
        if embedding_space != self.meta.embedding_space:
            raise VectorIndexError(
                f"{self.folder} holds vectors of embedding space {self.meta.embedding_space}, "
                f"the query is of {embedding_space}: they do not compare; embed the catalog "
                f"again with this model, or query with --model "
                f"{self.meta.model}/{self.meta.version}"
            )
        query = np.asarray(query, np.float32).reshape(1, -1)
        if query.shape[1] != self.meta.dim:
            raise VectorIndexError(
                f"the query has {query.shape[1]} dimensions, the index {self.meta.dim}"
            )
        scores, rows = self._index.search(query, min(k, self.meta.count))
        return [
            Neighbour(str(self._keys[row]), float(score))
            for row, score in zip(rows[0], scores[0], strict=True)
            if row >= 0
        ]
