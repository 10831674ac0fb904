"""The embedding job's inputs, shards, resume and retries, against a stand-in for the server's
stream (tests/fake_embeddings.py); the job against the real server is in
tests/integration/test_catalog.py. The 200,000-image test runs the job in a process of its
own, kills it (SIGKILL) after a commit, runs it again and checks every key once, each with
its own image's vector, in under 1 GB."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clients import embed_job
from clients.catalog_inputs import CatalogInputs, InputError
from clients.embed_job import EmbedJob
from clients.shard_store import FAILURES, STATE, JobIdentity, OutputError, ShardStore, shard_paths

from conftest import ROOT
from fake_embeddings import SPACE, FakeEmbeddings, vector_of


def _images(folder: Path, n: int, bad: tuple[int, ...] = ()) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"{i:05d}.jpg"
        path.write_bytes((b"bad" if i in bad else b"img") + str(i).encode())
        paths.append(path)
    return paths


def _job(inputs: CatalogInputs, dim: int = 8, space: str = SPACE) -> JobIdentity:
    scan = inputs.scan()
    return JobIdentity(scan.fingerprint, scan.count, "fake", "1", space, dim)


def _read(out: Path) -> tuple[list[str], np.ndarray]:
    tables = [pq.read_table(path) for path in shard_paths(out)]
    keys = [k for t in tables for k in t.column("key").to_pylist()]
    vectors = np.concatenate(
        [np.stack(t.column("vector").to_numpy(zero_copy_only=False)) for t in tables]
    )
    return keys, vectors


def _run(store: ShardStore, inputs, fake: FakeEmbeddings, **options) -> EmbedJob:
    job = EmbedJob(store, inputs, model="fake/1", **options)
    asyncio.run(job.run(fake.stream))
    store.close()
    return job


# -- inputs -------------------------------------------------------------------------------------


def test_a_manifest_lists_images_as_text_csv_or_parquet(tmp_path) -> None:
    files = _images(tmp_path / "photos", 5)
    paths = [str(p) for p in files]
    names = [f"photos/{p.name}" for p in files]  # relative to the manifest's folder
    (tmp_path / "list.txt").write_text("\n".join(names) + "\n\n")
    with (tmp_path / "list.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sku", "image"])
        writer.writerows([f"sku-{i}", name] for i, name in enumerate(names))
    pq.write_table(
        pa.table({"image": names, "sku": [f"sku-{i}" for i in range(5)]}), tmp_path / "list.parquet"
    )

    text = list(CatalogInputs(manifest=tmp_path / "list.txt"))
    assert [i.key for i in text] == names and [i.path for i in text] == paths
    assert [i.ordinal for i in text] == list(range(5))
    for manifest in ("list.csv", "list.parquet"):
        rows = list(
            CatalogInputs(manifest=tmp_path / manifest, path_column="image", key_column="sku")
        )
        assert [(i.key, i.path) for i in rows] == [(f"sku-{i}", p) for i, p in enumerate(paths)]
    folder = list(CatalogInputs([tmp_path / "photos"], image_suffixes=[".jpg"]))
    assert [i.path for i in folder] == paths
    assert CatalogInputs(manifest=tmp_path / "list.txt").scan().count == 5


def test_a_changed_list_has_another_fingerprint_and_a_repeated_key_is_refused(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("x.jpg\ny.jpg\n")
    (tmp_path / "b.txt").write_text("y.jpg\nx.jpg\n")
    a, b = (CatalogInputs(manifest=tmp_path / n).scan() for n in ("a.txt", "b.txt"))
    assert a.count == b.count == 2 and a.fingerprint != b.fingerprint
    (tmp_path / "c.txt").write_text("x.jpg\ny.jpg\nx.jpg\n")
    with pytest.raises(InputError, match=r"key 'x.jpg' appears more than once .*line/row 3"):
        CatalogInputs(manifest=tmp_path / "c.txt").scan()
    (tmp_path / "d.csv").write_text("file\nx.jpg\n")
    with pytest.raises(InputError, match=r"has no column 'path' .*its columns: file"):
        CatalogInputs(manifest=tmp_path / "d.csv").scan()


def test_a_file_name_that_is_not_utf8_is_named(tmp_path) -> None:
    (tmp_path / "ok.jpg").write_bytes(b"jpeg")
    with open(os.path.join(bytes(tmp_path), b"caf\xe9.jpg"), "wb") as f:
        f.write(b"jpeg")
    with pytest.raises(InputError, match=r"caf\\udce9.jpg' \(image 1\): its name is not valid"):
        CatalogInputs([tmp_path]).scan()


def test_a_list_read_again_hands_out_only_the_scans_entries(tmp_path, monkeypatch) -> None:
    """Each block of the list is checked against the scan before any of it is handed out:
    a list changed since stops before the first block that differs, one that runs longer
    stops at the scan's count; check() then says the inputs changed."""
    from clients import catalog_inputs

    monkeypatch.setattr(catalog_inputs, "BLOCK", 2)
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("a", "b", "c", "d", "e"):
        (folder / f"{name}.jpg").write_bytes(b"jpeg")
    inputs = CatalogInputs([folder])
    scan = inputs.scan()
    assert len(scan.blocks) == 3  # a b | c d | e
    same = inputs.as_scanned(scan)
    assert [Path(item.path).stem for item in same] == ["a", "b", "c", "d", "e"]
    same.check()

    (folder / "d.jpg").rename(folder / "dd.jpg")  # as many files; the second block differs
    renamed = inputs.as_scanned(scan)
    assert [Path(item.path).stem for item in renamed] == ["a", "b"]
    with pytest.raises(InputError, match="the inputs changed while the job ran"):
        renamed.check()

    (folder / "dd.jpg").rename(folder / "d.jpg")
    (folder / "f.jpg").write_bytes(b"jpeg")  # one more than the scan: never handed out
    longer = inputs.as_scanned(scan)
    assert [Path(item.path).stem for item in longer] == ["a", "b", "c", "d", "e"]
    assert longer.changed

    (folder / "f.jpg").unlink()
    (folder / "e.jpg").unlink()  # one fewer: the last block is never whole
    shorter = inputs.as_scanned(scan)
    assert [Path(item.path).stem for item in shorter] == ["a", "b", "c", "d"]
    assert shorter.changed


# -- shards, failures, retries -------------------------------------------------------------------


def test_every_image_once_in_shards_of_at_most_n_rows_and_failures_listed(tmp_path) -> None:
    paths = _images(tmp_path / "photos", 250, bad=(7, 100))
    (tmp_path / "photos" / "00050.jpg").unlink()  # listed, gone by the time it is read
    inputs = CatalogInputs(manifest=_manifest(tmp_path, paths))
    out = tmp_path / "out"
    store = ShardStore(out, _job(inputs), shard_rows=100, row_group_rows=30)
    job = _run(store, inputs, FakeEmbeddings(dim=8), batch_size=7, in_flight=3)
    assert (job.embedded, job.failed) == (247, 3)

    keys, vectors = _read(out)
    expected = [str(p) for i, p in enumerate(paths) if i not in (7, 50, 100)]
    assert sorted(keys) == expected  # each once
    by_key = dict(zip(keys, vectors, strict=True))
    for path in paths[:20]:
        if str(path) in by_key:
            np.testing.assert_array_equal(by_key[str(path)], vector_of(path.read_bytes(), 8))
    rows = [pq.ParquetFile(p).metadata for p in shard_paths(out)]
    assert [m.num_rows for m in rows] == [100, 100, 47]
    first = rows[0]
    assert [first.row_group(g).num_rows for g in range(first.num_row_groups)] == [30, 30, 30, 10]
    schema = pq.read_schema(shard_paths(out)[0])
    assert schema.metadata[b"raystream.embedding_space"] == SPACE.encode()
    assert schema.names == ["key", "vector", "model", "version", "embedding_space"]

    failures = [json.loads(line) for line in (out / FAILURES).read_text().splitlines()]
    assert {(Path(f["path"]).name, f["code"]) for f in failures} == {
        ("00007.jpg", "INVALID_ARGUMENT"),
        ("00100.jpg", "INVALID_ARGUMENT"),
        ("00050.jpg", "NOT_FOUND"),
    }
    state = json.loads((out / STATE).read_text())["committed"]
    assert state["complete"] and state["done_below"] == 250 and state["done_above"] == []


def _manifest(folder: Path, paths: list[Path]) -> Path:
    manifest = folder / "manifest.txt"
    manifest.write_text("".join(f"{p}\n" for p in paths))
    return manifest


def test_unavailable_images_are_retried_with_backoff_then_listed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(embed_job, "FIRST_BACKOFF_S", 0.01)
    paths = _images(tmp_path / "photos", 20)
    fake = FakeEmbeddings(dim=8, unavailable={b"img3": 2, b"img4": 99})
    inputs = CatalogInputs(manifest=_manifest(tmp_path, paths))
    store = ShardStore(tmp_path / "out", _job(inputs))
    job = _run(store, inputs, fake, batch_size=4, attempts=3)
    assert (job.embedded, job.failed) == (19, 1)
    assert fake.unavailable == {b"img3": 0, b"img4": 96}  # img4 tried 3 times, no more
    (failure,) = [
        json.loads(line) for line in (tmp_path / "out" / FAILURES).read_text().splitlines()
    ]
    assert failure["code"] == "UNAVAILABLE" and "after 3 tries" in failure["message"]
    assert Path(failure["path"]).name == "00004.jpg"
    assert len(_read(tmp_path / "out")[0]) == 19


def test_float16_vectors_take_half_the_bytes_at_cosine_0_9999(tmp_path) -> None:
    paths = _images(tmp_path / "photos", 300)
    inputs = CatalogInputs(manifest=_manifest(tmp_path, paths))
    sizes, vectors = {}, {}
    for dtype in ("float32", "float16"):
        out = tmp_path / dtype
        job = JobIdentity(**{**_job(inputs, dim=1280).__dict__, "dtype": dtype})
        _run(ShardStore(out, job), inputs, FakeEmbeddings(dim=1280))
        sizes[dtype] = sum(p.stat().st_size for p in shard_paths(out))
        keys, vectors[dtype] = _read(out)
        assert keys == [str(p) for p in paths]  # one stream, answered in order
    assert vectors["float16"].dtype == np.float16
    half = vectors["float16"].astype(np.float32)
    cosine = (half * vectors["float32"]).sum(1) / np.linalg.norm(half, axis=1)
    assert cosine.min() >= 0.9999
    assert 0.45 <= sizes["float16"] / sizes["float32"] <= 0.55, sizes


class _BrokenStreams(FakeEmbeddings):
    """Each of the first `breaks` streams answers `answers` requests, then fails UNAVAILABLE
    (leaving the rest unanswered, as a server that went away)."""

    def __init__(self, breaks: int, answers: int = 2) -> None:
        super().__init__(dim=8)
        self.breaks = breaks
        self.answers = answers

    async def stream(self, requests):
        import grpc

        answered = 0
        async for response in super().stream(requests):
            if self.breaks and answered == self.answers:
                self.breaks -= 1
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
                )
            answered += 1
            yield response


def test_a_stream_that_fails_is_opened_again_and_then_given_up(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(embed_job, "FIRST_BACKOFF_S", 0.01)
    paths = _images(tmp_path / "photos", 40)
    inputs = CatalogInputs(manifest=_manifest(tmp_path, paths))
    # more breaks than attempts (3), each after some progress: the job goes on to the end
    store = ShardStore(tmp_path / "a", _job(inputs))
    job = _run(store, inputs, _BrokenStreams(4), batch_size=4, attempts=3)
    assert (job.embedded, job.failed) == (40, 0)
    assert sorted(_read(tmp_path / "a")[0]) == [str(p) for p in paths]

    store = ShardStore(tmp_path / "b", _job(inputs))
    gone = EmbedJob(store, inputs, model="fake/1", batch_size=4, attempts=3)
    first, then_none = _BrokenStreams(1), _BrokenStreams(99, answers=0)
    streams = iter([first.stream, *[then_none.stream] * 99])  # 2 requests answered, then none
    with pytest.raises(embed_job.ServerGone, match=r"failed 3 streams in a row .*run the same"):
        asyncio.run(gone.run(lambda requests: next(streams)(requests)))
    assert store.committed.vectors == gone.embedded == 2 * 4  # committed before giving up


def test_a_stream_that_fails_while_the_source_stalls_loses_no_image(tmp_path) -> None:
    """Images handed out by another process (`--senders`) may pause: a stream that fails
    meanwhile leaves the images the job had taken to be sent again, and the source goes on
    (each of the 20 embedded once)."""
    import grpc

    paths = _images(tmp_path / "photos", 20)
    inputs = CatalogInputs(manifest=_manifest(tmp_path, paths))
    fake, broke = FakeEmbeddings(dim=8), asyncio.Event()

    async def source():
        for item in list(inputs)[:10]:
            yield item
        await broke.wait()  # nothing for a while: the parent is busy with another sender
        for item in list(inputs)[10:]:
            yield item

    async def stream(requests):
        """As the client does: its own task sends; the first stream fails after two
        answers, with that task cancelled wherever it waits."""
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            async for request in requests:
                await queue.put(request)
            await queue.put(None)

        sender = asyncio.ensure_future(send())
        try:
            answered = 0
            while (request := await queue.get()) is not None:
                if answered == 2 and not broke.is_set():
                    await asyncio.sleep(0.05)  # the next request now waits for images
                    broke.set()
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), ""
                    )
                async for response in fake.stream(_one(request)):
                    yield response
                answered += 1
        finally:
            sender.cancel()

    store = ShardStore(tmp_path / "out", _job(inputs))
    job = EmbedJob(store, source(), model="fake/1", batch_size=4, attempts=3)
    asyncio.run(job.run(stream))
    store.close()
    assert (job.embedded, job.failed) == (20, 0)
    assert sorted(_read(tmp_path / "out")[0]) == [str(p) for p in paths]


async def _one(request):
    yield request


# -- resume --------------------------------------------------------------------------------------


def test_a_resumed_store_skips_what_was_committed_and_drops_what_was_not(tmp_path) -> None:
    paths = _images(tmp_path / "photos", 10)
    inputs = CatalogInputs(manifest=_manifest(tmp_path, paths))
    out = tmp_path / "out"
    store = ShardStore(out, _job(inputs), shard_rows=4)
    for item in list(inputs)[:6]:  # out of order, as responses come: 0-3 committed in a shard
        store.add(item.ordinal, item.key, np.ones(8, np.float32))
    store.fail(9, "k9", "p9", "INVALID_ARGUMENT", "bad")
    store.commit()  # 4, 5 and 9 committed too, in a second shard
    store.add(7, "k7", np.ones(8, np.float32))  # then killed before the next commit
    store._write_group()  # its rows reached the temporary file
    (out / "shard-00002.parquet").write_bytes(b"renamed, but the state never named it")

    again = ShardStore(out, _job(inputs), shard_rows=4)
    assert [again.is_done(o) for o in range(10)] == [True] * 6 + [False] * 3 + [True]
    assert again.done == 7 and not (out / "shard-00002.parquet").exists()
    assert not list(out.glob(".*.tmp"))
    assert (out / FAILURES).read_text().count("\n") == 1


def test_another_list_or_embedding_space_is_refused(tmp_path) -> None:
    paths = _images(tmp_path / "photos", 4)
    inputs = CatalogInputs(manifest=_manifest(tmp_path, paths))
    ShardStore(tmp_path / "out", _job(inputs)).close()
    with pytest.raises(
        OutputError, match=r"holds vectors of embedding space fake/1/sha256:0.*do not compare"
    ):
        ShardStore(tmp_path / "out", _job(inputs, space="other/2/sha256:1"))
    fewer = CatalogInputs(manifest=_manifest(tmp_path, paths[:3]))
    with pytest.raises(OutputError, match=r"was made from another list of images \(4 images"):
        ShardStore(tmp_path / "out", _job(fewer))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"is not empty and holds no embed-state.json"):
        ShardStore(tmp_path / "full", _job(inputs))


# -- at scale ------------------------------------------------------------------------------------

CATALOG = 200_000
DISTINCT = 1_000  # image files; key i is file i % 1000 (file 0 is not an image)

RUN_JOB = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, "tests")
from fake_embeddings import SPACE, FakeEmbeddings
from clients.catalog_inputs import CatalogInputs
from clients.embed_job import EmbedJob
from clients.shard_store import JobIdentity, ShardStore

inputs = CatalogInputs(manifest=sys.argv[1], key_column="key")
scan = inputs.scan()
job = JobIdentity(scan.fingerprint, scan.count, "fake", "1", SPACE, 1280)
store = ShardStore(Path(sys.argv[2]), job, shard_rows=20_000, row_group_rows=5_000)
run = EmbedJob(store, inputs, model="fake/1", batch_size=16, in_flight=16)
asyncio.run(run.run(FakeEmbeddings(dim=1280).stream))
store.close()
# VmHWM: this program's peak; getrusage's ru_maxrss keeps the parent's across fork and exec
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]
print(run.embedded, run.failed, peak)
"""


def test_200k_images_killed_and_resumed_each_key_once_in_bounded_memory(tmp_path) -> None:
    files = _images(tmp_path / "photos", DISTINCT, bad=(0,))
    manifest = tmp_path / "catalog.csv"
    with manifest.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "path"])
        writer.writerows((f"sku-{i}", f"photos/{i % DISTINCT:05d}.jpg") for i in range(CATALOG))
    out = tmp_path / "out"
    command = [sys.executable, "-c", RUN_JOB, str(manifest), str(out)]

    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while first.poll() is None and time.monotonic() < deadline:  # until a shard is committed
        state = out / STATE
        if state.is_file() and json.loads(state.read_text())["committed"]["shards"]:
            break
        time.sleep(0.05)  # polling the state file the job writes
    assert first.poll() is None, "the job finished before it could be killed"
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    killed = json.loads((out / STATE).read_text())["committed"]
    assert 0 < killed["done_below"] < CATALOG

    second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr
    embedded, failed, max_rss_kb = map(int, second.stdout.split())
    assert embedded + failed < CATALOG - killed["done_below"] + 1  # the committed: not again
    assert max_rss_kb < 1_000_000, f"{max_rss_kb / 1e3:.0f} MB"

    keys, vectors = _read(out)
    wanted = {f"sku-{i}" for i in range(CATALOG) if i % DISTINCT}
    assert len(keys) == len(wanted) and set(keys) == wanted  # every key once
    failures = [json.loads(line) for line in (out / FAILURES).read_text().splitlines()]
    assert sorted(f["key"] for f in failures) == sorted(
        f"sku-{i}" for i in range(0, CATALOG, DISTINCT)
    )
    reference = {i: vector_of(files[i].read_bytes(), 1280) for i in (1, 2, 999)}
    for row in range(0, len(keys), 997):
        i = int(keys[row].removeprefix("sku-")) % DISTINCT
        if i in reference:
            np.testing.assert_array_equal(vectors[row], reference[i])
        else:
            np.testing.assert_array_equal(vectors[row], vector_of(files[i].read_bytes(), 1280))
