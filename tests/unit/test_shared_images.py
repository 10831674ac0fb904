"""The shared-memory handoff of images (serve_app/transport/shared_images.py): a batch's images
written into a segment come back whole on the other side; segments are reused, bounded, reserved
whole, and removed with their process."""

from __future__ import annotations

import os
import subprocess

import pytest

from serve_app.core.messages import Batch, Job
from serve_app.transport import shared_images
from serve_app.transport.shared_images import ImageReader, ImageWriter, SharedImagesMissing


@pytest.fixture(autouse=True)
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_images, "SHM_DIR", tmp_path)
    monkeypatch.setattr(shared_images, "MIN_SEGMENT_BYTES", 1 << 20)
    return tmp_path


def _batch(sizes: list[list[int]]) -> Batch:
    jobs = tuple(
        Job(id=f"j{j}", images=tuple(os.urandom(size) for size in images), top_k=3)
        for j, images in enumerate(sizes)
    )
    return Batch(jobs=jobs, model="m/1")


def test_images_come_back_whole_and_in_order() -> None:
    writer, reader = ImageWriter(8 << 20), ImageReader()
    batch = _batch([[1000, 70_000], [], [5]])
    stripped, where = writer.put(batch)
    assert all(job.images == () for job in stripped.jobs)
    assert [job.count for job in stripped.jobs] == [2, 0, 1]  # counts kept
    assert reader.restore(stripped, where) == batch
    writer.release(where.name)
    writer.close()
    reader.close()


def test_a_segment_is_lent_again_after_its_call_and_bounded(shm_dir) -> None:
    writer = ImageWriter(3 << 20)
    _, first = writer.put(_batch([[1000]]))
    _, second = writer.put(_batch([[1000]]))  # the first is still lent: another segment
    assert first.name != second.name
    writer.release(first.name)
    _, third = writer.put(_batch([[2000]]))
    assert third.name == first.name
    assert writer.put(_batch([[2 << 20]])) is None  # no room left: the call carries them
    writer.release(second.name)
    writer.release(third.name)
    _, big = writer.put(_batch([[2 << 20]]))  # a free small one makes room
    assert sorted(p.stat().st_size for p in shm_dir.iterdir()) == [1 << 20, 2 << 20]
    writer.release(big.name, reuse=False)  # a callee could not map it: dropped
    assert len(list(shm_dir.iterdir())) == 1
    assert writer.put(_batch([[], []])) is None  # no images: nothing to hand over


def test_the_reader_lets_go_of_segments_their_writer_has_removed(monkeypatch) -> None:
    """A removed segment's memory is freed only once nobody maps it: a callee must not keep
    the mappings of a writer that grew its segments or stopped (an ingress redeployed)."""
    monkeypatch.setattr(shared_images, "SWEEP_S", 0.0)
    writer, reader = ImageWriter(8 << 20), ImageReader()
    batch = _batch([[1000]])
    stripped, old = writer.put(batch)
    assert reader.restore(stripped, old) == batch
    writer.release(old.name, reuse=False)  # removed
    stripped, new = writer.put(batch)
    assert reader.restore(stripped, new) == batch
    assert list(reader._maps) == [new.name]
    writer.close()
    reader.close()


def test_without_shared_memory_the_call_carries_the_images(shm_dir) -> None:
    writer = ImageWriter(8 << 20)
    shm_dir.rmdir()  # no /dev/shm here (or a full one: posix_fallocate fails alike)
    assert writer.put(_batch([[1000]])) is None


def test_the_reader_maps_only_raystream_segments_that_exist() -> None:
    reader = ImageReader()
    with pytest.raises(SharedImagesMissing, match="not a raystream image segment"):
        reader.restore(_batch([[1]]), shared_images.SharedImages("../etc/passwd", ((1,),)))
    gone = f"{shared_images.PREFIX}{os.getpid()}-abc123"
    with pytest.raises(SharedImagesMissing, match="cannot open"):
        reader.restore(_batch([[1]]), shared_images.SharedImages(gone, ((1,),)))


def test_segments_of_dead_processes_are_removed_as_a_writer_starts(shm_dir) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    orphan = shm_dir / f"{shared_images.PREFIX}{child.pid}-0a1b2c"
    mine = shm_dir / f"{shared_images.PREFIX}{os.getpid()}-0a1b2c"
    other = shm_dir / "someone-elses"
    for path in (orphan, mine, other):
        path.write_bytes(b"x")
    ImageWriter(1 << 20)
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([mine.name, other.name])
