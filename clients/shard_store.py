"""The output folder of an embedding job: Parquet shards of vectors, a failures file, and a
state file that says which shards and which images are committed. A job killed at any point
(SIGKILL included) and run again goes on from its last commit, and every image ends up exactly
once, in one shard or in the failures file.

    out/
      embed-state.json        what the job is (its inputs' fingerprint, model, embedding space)
                              and what is committed: shards, images done, the failures' length
      shard-00000.parquet     key, vector, model, version, embedding_space; <= shard_rows rows
      failures.jsonl          a line per image that failed: key, path, code, message

A shard is written to a temporary file, renamed once complete, and only then named in the
state (written the same way): a shard the state does not name, left by a kill between the
two renames, is deleted on resume and its images embedded again. Images are done by their
ordinal in the input list; the state keeps them as "all below W" and the few above W done out
of order (at most the requests in flight and the shard's rows), so it stays small whatever the
catalog's size. Memory: one row group of vectors (`row_group_rows` x dim floats).
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from clients.catalog_errors import CatalogError

logger = logging.getLogger(__name__)

STATE = "embed-state.json"
FAILURES = "failures.jsonl"
SHARD_GLOB = "shard-*.parquet"
STATE_VERSION = 1
DTYPES = ("float32", "float16")


class OutputError(CatalogError):
    """The output folder cannot take this job: one line for the user."""


@dataclass(frozen=True)
class JobIdentity:
    """What the vectors in an output folder are: a resumed job must be the same job."""

    inputs_fingerprint: str
    images: int
    model: str
    version: str
    embedding_space: str
    dim: int
    dtype: str = "float32"  # as stored: the server's float32, or rounded to float16


@dataclass
class Committed:
    done_below: int = 0  # every ordinal below is done
    done_above: list[int] = field(default_factory=list)  # and these, sorted
    shards: list[dict] = field(default_factory=list)  # {"name", "rows"}
    vectors: int = 0
    failures: int = 0
    failures_bytes: int = 0
    complete: bool = False


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def read_state(out: Path) -> tuple[JobIdentity, Committed] | None:
    path = out / STATE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return JobIdentity(**data["job"]), Committed(**data["committed"])
    except (ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"{path} is not the state of `raystream embed`: {exc}") from None


def shard_paths(out: Path) -> list[Path]:
    """The committed shards of an output folder, in order."""
    state = read_state(out)
    if state is None:
        raise OutputError(f"{out}: no {STATE} (not an output folder of `raystream embed`)")
    return [out / shard["name"] for shard in state[1].shards]


class ShardStore:
    """An output folder, created for a job or resumed; `add` and `fail` each image once."""

    def __init__(
        self,
        out: Path,
        job: JobIdentity,
        *,
        shard_rows: int = 50_000,
        row_group_rows: int = 10_000,
    ) -> None:
        import pyarrow as pa

        if job.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {job.dtype!r}")
        if shard_rows < 1 or row_group_rows < 1:
            raise ValueError("shard_rows and row_group_rows must be at least 1")
        self.out = out
        self.job = job
        self._shard_rows = shard_rows
        self._group_rows = min(row_group_rows, shard_rows)
        self._pa = pa
        out.mkdir(parents=True, exist_ok=True)
        state = read_state(out)
        if state is None:
            if any(out.iterdir()):
                raise OutputError(
                    f"{out} is not empty and holds no {STATE}: give an empty or new folder"
                )
            self.committed = Committed()
        else:
            self._check_same_job(state[0])
            self.committed = state[1]
        self._done_above = set(self.committed.done_above)
        self._clean_uncommitted()
        self._failures = (out / FAILURES).open("ab")
        self._failures.truncate(self.committed.failures_bytes)
        self._failures.seek(self.committed.failures_bytes)
        # the open shard: rows written to its temporary file, and the row group being filled
        self._writer = None
        self._shard_ordinals: list[int] = []
        self._failed_ordinals: list[int] = []
        self._group_keys: list[str] = []
        self._group = np.empty((self._group_rows, job.dim), np.dtype(job.dtype))
        # Row groups are encoded and written on a thread of their own (pyarrow releases the
        # GIL), one at a time, while the caller's event loop goes on receiving vectors.
        self._write_thread = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self._writing: Future | None = None
        self._opened = time.monotonic()
        if state is None:
            self._write_state()

    # -- resume --------------------------------------------------------------------------------

    def _check_same_job(self, found: JobIdentity) -> None:
        job = self.job
        if found.embedding_space != job.embedding_space or found.dim != job.dim:
            raise OutputError(
                f"{self.out} holds vectors of embedding space {found.embedding_space} "
                f"({found.model} version {found.version}); the server embeds in "
                f"{job.embedding_space}: they do not compare. Give another --out, or embed with "
                f"--model {found.model}/{found.version} where the server serves it"
            )
        if found.dtype != job.dtype:
            raise OutputError(
                f"{self.out} holds {found.dtype} vectors, not {job.dtype}: give another --out"
            )
        if (found.inputs_fingerprint, found.images) != (job.inputs_fingerprint, job.images):
            raise OutputError(
                f"{self.out} was made from another list of images ({found.images} images, "
                f"fingerprint {found.inputs_fingerprint[:12]}; these inputs: {job.images}, "
                f"{job.inputs_fingerprint[:12]}): run the same command again to go on, or give "
                f"another --out"
            )

    def _clean_uncommitted(self) -> None:
        """Deletes what a killed job left beyond its last commit."""
        named = {shard["name"] for shard in self.committed.shards}
        for path in self.out.glob(SHARD_GLOB):
            if path.name not in named:
                logger.info("deleting %s, written after the last commit", path)
                path.unlink()
        for path in self.out.glob(".*.tmp"):
            path.unlink()

    def is_done(self, ordinal: int) -> bool:
        return ordinal < self.committed.done_below or ordinal in self._done_above

    @property
    def done(self) -> int:
        """Images committed (embedded or failed)."""
        return self.committed.done_below + len(self._done_above)

    @property
    def complete(self) -> bool:
        return self.committed.complete

    # -- rows ------------------------------------------------------------------------------------

    def add(self, ordinal: int, key: str, vector: np.ndarray) -> None:
        """One image's vector; commits the shard once it holds shard_rows rows."""
        self._group[len(self._group_keys)] = vector
        self._group_keys.append(key)
        self._shard_ordinals.append(ordinal)
        if len(self._group_keys) == self._group_rows:
            self._write_group()
        if len(self._shard_ordinals) >= self._shard_rows:
            self.commit()

    def fail(self, ordinal: int, key: str, path: str, code: str, message: str) -> None:
        line = {"key": key, "path": path, "code": code, "message": message}
        self._failures.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
        self._failed_ordinals.append(ordinal)

    @property
    def seconds_open(self) -> float:
        """Since the last commit."""
        return time.monotonic() - self._opened

    def _write_group(self) -> None:
        import pyarrow.parquet as pq

        pa = self._pa
        rows = len(self._group_keys)
        if not rows:
            return
        job = self.job
        value_type = pa.float16() if job.dtype == "float16" else pa.float32()
        flat = pa.array(self._group[:rows].reshape(-1), value_type)

        def repeated(text: str):
            return pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(rows, np.int32)), pa.array([text], pa.string())
            )

        table = pa.table(
            {
                "key": pa.array(self._group_keys, pa.string()),
                "vector": pa.FixedSizeListArray.from_arrays(flat, job.dim),
                "model": repeated(job.model),
                "version": repeated(job.version),
                "embedding_space": repeated(job.embedding_space),
            }
        )
        if self._writer is None:
            metadata = {f"raystream.{k}": str(v) for k, v in asdict(job).items()}
            schema = table.schema.with_metadata(metadata)
            # no dictionary for keys and vectors: distinct values, where one only adds bytes;
            # no compression of the vectors, whose float bits compress by a few percent only
            self._writer = pq.ParquetWriter(
                self._temporary(),
                schema,
                use_dictionary=["model", "version", "embedding_space"],
                compression={name: "snappy" for name in table.column_names} | {"vector": "none"},
            )
        self._wait_for_write()
        self._writing = self._write_thread.submit(
            self._writer.write_table, table, row_group_size=rows
        )
        self._group_keys = []
        # the table may share the buffer's memory: the next group gets a new one
        self._group = np.empty_like(self._group)

    def _wait_for_write(self) -> None:
        if self._writing is not None:
            self._writing, writing = None, self._writing
            writing.result()  # a write's error is raised here

    def _shard_name(self) -> str:
        return f"shard-{len(self.committed.shards):05d}.parquet"

    def _temporary(self) -> Path:
        return self.out / f".{self._shard_name()}.tmp"

    def commit(self) -> None:
        """Makes everything added or failed so far durable: the open shard complete and
        renamed, the failures flushed, then the state that names them."""
        self._write_group()
        self._wait_for_write()
        committed = self.committed
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            with self._temporary().open("rb") as f:
                os.fsync(f.fileno())
            name = self._shard_name()
            os.replace(self._temporary(), self.out / name)
            committed.shards.append({"name": name, "rows": len(self._shard_ordinals)})
            committed.vectors += len(self._shard_ordinals)
        self._failures.flush()
        os.fsync(self._failures.fileno())
        committed.failures_bytes = self._failures.tell()
        committed.failures += len(self._failed_ordinals)
        self._done_above.update(self._shard_ordinals)
        self._done_above.update(self._failed_ordinals)
        self._shard_ordinals, self._failed_ordinals = [], []
        while committed.done_below in self._done_above:  # the done prefix grows
            self._done_above.remove(committed.done_below)
            committed.done_below += 1
        committed.complete = committed.done_below >= self.job.images
        self._write_state()
        self._opened = time.monotonic()

    def _write_state(self) -> None:
        self.committed.done_above = sorted(self._done_above)
        state = {
            "format": STATE_VERSION,
            "job": asdict(self.job),
            "committed": asdict(self.committed),
        }
        _write_atomically(self.out / STATE, json.dumps(state, indent=1).encode())

    def close(self) -> None:
        """Commits what is open and closes the files."""
        self.commit()
        self._write_thread.shutdown()
        self._failures.close()
