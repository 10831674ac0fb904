"""The images of an embedding job: files and folders named on the command line, or a manifest
(a text file of paths, or a column of paths in a CSV or Parquet file, with an optional column of
keys). Read twice, streamed both times, never held whole: a first pass counts the images, checks
that no key appears twice and fingerprints the list (a resumed job must see the same list); the
second hands out (ordinal, key, path) in the list's order, checked against the first
(`ScannedList`): a folder that changed between the two is reported, not embedded silently.

A manifest's relative paths are relative to the manifest's folder. An image's key is the key
column's value where there is one, else its path as the manifest writes it.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clients.catalog_errors import CatalogError

logger = logging.getLogger(__name__)

MANIFEST_FORMATS = ("text", "csv", "parquet")
_BATCH_ROWS = 65_536  # Parquet rows read at a time
BLOCK = 4_096  # entries of the list checked at once as it is read again (ScannedList)


class InputError(CatalogError):
    """The inputs cannot be read: one line for the user."""


@dataclass(frozen=True)
class CatalogItem:
    ordinal: int  # its place in the list, from 0: what a resumed job skips by
    key: str
    path: str  # a string, not a Path: millions of them are made, and pathlib is slow


@dataclass(frozen=True)
class Scan:
    count: int
    fingerprint: str  # of every (key, path) in order: another list, another fingerprint
    # of each BLOCK of the list's entries in turn (16 bytes each: 40 KB for 10 million), so
    # that the list read again is checked before any entry of a block is sent
    blocks: tuple[bytes, ...]


def manifest_format(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}.get(suffix, "text")


class CatalogInputs:
    """Paths and folders (`paths`), or a manifest (`manifest`, with `path_column` and
    `key_column` for CSV and Parquet)."""

    def __init__(
        self,
        paths: Sequence[str | Path] = (),
        *,
        manifest: str | Path | None = None,
        path_column: str = "path",
        key_column: str | None = None,
        image_suffixes: Sequence[str] = (),
    ) -> None:
        if bool(paths) == (manifest is not None):
            raise InputError("give image paths or folders, or a manifest: one or the other")
        self._paths = [Path(p) for p in paths]
        self._manifest = Path(manifest) if manifest is not None else None
        self._path_column = path_column
        self._key_column = key_column
        self._suffixes = {s.lower() for s in image_suffixes}
        if self._manifest is not None and not self._manifest.is_file():
            raise InputError(f"{self._manifest}: no such manifest file")

    def __iter__(self) -> Iterator[CatalogItem]:
        rows = self._manifest_rows() if self._manifest is not None else self._named_rows()
        for ordinal, (key, path) in enumerate(rows):
            yield CatalogItem(ordinal, key, path)

    def scan(self) -> Scan:
        """Counts, fingerprints and checks the list for a key given twice (8 bytes a key:
        80 MB for 10 million)."""
        digest, block = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        blocks: list[bytes] = []
        key_hashes: list[np.ndarray] = []
        chunk: list[int] = []
        count = 0
        for item in self:
            entry = _entry(item)
            digest.update(entry)
            block.update(entry)
            chunk.append(int.from_bytes(hashlib.blake2b(item.key.encode(), digest_size=8).digest()))
            count += 1
            if count % BLOCK == 0:
                blocks.append(block.digest())
                block = hashlib.blake2b(digest_size=16)
            if len(chunk) == _BATCH_ROWS:
                key_hashes.append(np.array(chunk, np.uint64))
                chunk = []
        if count % BLOCK:
            blocks.append(block.digest())
        key_hashes.append(np.array(chunk, np.uint64))
        if count == 0:
            source = self._manifest or ", ".join(map(str, self._paths))
            raise InputError(f"no images found in {source}")
        hashes = np.sort(np.concatenate(key_hashes))
        repeated = hashes[1:][hashes[1:] == hashes[:-1]]
        if len(repeated):
            self._name_repeated_key(int(repeated[0]))
        return Scan(count, digest.hexdigest(), tuple(blocks))

    def as_scanned(self, scan: Scan) -> ScannedList:
        return ScannedList(self, scan)

    def _name_repeated_key(self, key_hash: int) -> None:
        seen: set[str] = set()
        for item in self:
            if int.from_bytes(hashlib.blake2b(item.key.encode(), digest_size=8).digest()) != (
                key_hash
            ):
                continue
            if item.key in seen:
                raise InputError(
                    f"key {item.key!r} appears more than once in the inputs (line/row "
                    f"{item.ordinal + 1}); every image needs a key of its own"
                )
            seen.add(item.key)

    # -- the sources -------------------------------------------------------------------------

    def _named_rows(self) -> Iterator[tuple[str, str]]:
        for path in self._paths:
            if path.is_dir():
                found = sorted(
                    p
                    for p in path.rglob("*")
                    if p.is_file() and (not self._suffixes or p.suffix.lower() in self._suffixes)
                )
                for p in found:
                    yield str(p), str(p)
            elif path.is_file():
                yield str(path), str(path)
            else:
                raise InputError(f"{path}: no such file or directory")

    def _manifest_rows(self) -> Iterator[tuple[str, str]]:
        assert self._manifest is not None
        folder = str(self._manifest.parent)
        fmt = manifest_format(self._manifest)
        if fmt == "text":
            if self._key_column:
                raise InputError("--key-column needs a CSV or Parquet manifest")
            rows = self._text_rows()
        elif fmt == "csv":
            rows = self._csv_rows()
        else:
            rows = self._parquet_rows()
        for key, name in rows:
            yield key, os.path.join(folder, name)

    def _text_rows(self) -> Iterator[tuple[str, str]]:
        with self._manifest.open(encoding="utf-8") as lines:
            for line in lines:
                name = line.rstrip("\r\n")
                if name.strip():
                    yield name, name

    def _csv_rows(self) -> Iterator[tuple[str, str]]:
        with self._manifest.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            self._check_columns(reader.fieldnames or [])
            for row in reader:
                name = row[self._path_column]
                yield (row[self._key_column] if self._key_column else name), name

    def _parquet_rows(self) -> Iterator[tuple[str, str]]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError(
                "a Parquet manifest needs pyarrow: pip install 'raystream[parquet]'"
            ) from None
        manifest = pq.ParquetFile(self._manifest)
        self._check_columns(manifest.schema_arrow.names)
        columns = [self._path_column] + ([self._key_column] if self._key_column else [])
        for batch in manifest.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            names = batch.column(0).to_pylist()
            keys = batch.column(1).to_pylist() if self._key_column else names
            for key, name in zip(keys, names, strict=True):
                if name is None or key is None:
                    raise InputError(f"{self._manifest}: a row without a path or a key")
                yield str(key), str(name)

    def _check_columns(self, names: Sequence[str]) -> None:
        for wanted in (self._path_column, self._key_column):
            if wanted and wanted not in names:
                raise InputError(
                    f"{self._manifest} has no column {wanted!r} (its columns: "
                    f"{', '.join(names) or 'none'}); name the paths' column with --path-column"
                )


class ScannedList:
    """The inputs read again as a job sends them, each BLOCK of entries checked against the
    scan before any of them is handed out: a list that changed since (a file added to or
    removed from a folder, the manifest edited) stops at the first block that differs, so
    every entry handed out is the scan's, at the scan's place. `check()`, once read, raises
    InputError where it stopped so. Never more than the scan's count."""

    def __init__(self, inputs: CatalogInputs, scan: Scan) -> None:
        self._inputs, self._scan = inputs, scan
        self.changed = False

    def __iter__(self) -> Iterator[CatalogItem]:
        count, blocks = self._scan.count, self._scan.blocks
        block: list[CatalogItem] = []
        digest = hashlib.blake2b(digest_size=16)
        items = iter(self._inputs)
        for item in items:
            if item.ordinal >= count:
                break  # longer than the scan
            block.append(item)
            digest.update(_entry(item))
            if len(block) == BLOCK or item.ordinal == count - 1:
                if digest.digest() != blocks[item.ordinal // BLOCK]:
                    break
                yield from block
                block, digest = [], hashlib.blake2b(digest_size=16)
                if item.ordinal == count - 1:  # the scan's whole list, unless it runs on
                    self.changed = next(items, None) is not None
                    return
        self.changed = True  # it stopped short, ran longer, or a block differed

    def check(self) -> None:
        if self.changed:
            raise InputError(
                "the inputs changed while the job ran (a file added or removed, or the "
                "manifest edited): the images sent before the first change are committed, "
                "and the output holds the list as the job began it; run again with the "
                "inputs as they were, or embed into another --out"
            )


def _entry(item: CatalogItem) -> bytes:
    """An item as the fingerprint reads it."""
    try:
        return f"{item.key}\0{item.path}\n".encode()
    except UnicodeEncodeError:
        raise InputError(
            f"{item.path!r} (image {item.ordinal + 1}): its name is not valid UTF-8; "
            f"rename the file"
        ) from None
