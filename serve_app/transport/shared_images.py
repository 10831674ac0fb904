"""Images handed to a stage replica on the same node through shared memory, not sent in the
stage call (with `stage_ports`, on one node: up to SHARED_IMAGES_BYTES, serve_app/tuning.py).

A call over a stage port (serve_app/transport/stage_port.py) carries its batch pickled. Where the
batch holds the requests' encoded images (the call into the group that decodes them), those
bytes dominate the call: on the 2-core CPU machine a 5.6 MB call costs the caller 4.0 ms of
CPU and the callee 12.0 (`python bench/call_cost.py --payload-kb 5600`), against about 0.4 ms
to copy 5.6 MB twice. So, when the callee's address is on this node, the caller copies the
images into a segment of shared memory of its own (a file in /dev/shm, mapped), sends the
batch without them plus where they lie (SharedImages), and reuses the segment once the call
has returned; the callee maps the segment (once: mappings are kept) and copies the images
out before it runs the batch.

A segment is reserved whole when it is made (posix_fallocate), so a full /dev/shm fails
there, cleanly, and the call carries its images itself. A callee that cannot open the
segment (another node after all, or the file gone) raises SharedImagesMissing and the
caller sends the call again with the images in it. Segments are unlinked when their replica
stops; those of a process that was killed are removed by the next replica that starts on
the node (their names carry the owner's pid).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import mmap
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from serve_app.core.messages import Batch
from serve_app.tuning import MAPPINGS_KEPT, MIN_SEGMENT_BYTES, SWEEP_S
from serve_app.wire.request_images import buffers

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "raystream-images-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")


class SharedImagesMissing(Exception):
    """The callee could not map the caller's segment: send the images in the call."""


@dataclass(frozen=True)
class SharedImages:
    """Where a batch's images lie: in segment `name` from its start, job after job, image
    after image, `sizes[j][i]` bytes each."""

    name: str
    sizes: tuple[tuple[int, ...], ...]


class _Segment:
    def __init__(self, size: int) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.size = size
        path = SHM_DIR / self.name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not as SIGBUS
            self.map = mmap.mmap(fd, size)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        self.map.close()
        (SHM_DIR / self.name).unlink(missing_ok=True)


class ImageWriter:
    """The caller's side: segments of at most `max_bytes` in all, each lent to one call."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._free: list[_Segment] = []
        self._lent: dict[str, _Segment] = {}
        remove_orphans()

    def _bytes(self) -> int:
        return sum(s.size for s in self._free) + sum(s.size for s in self._lent.values())

    def put(self, batch: Batch) -> tuple[Batch, SharedImages] | None:
        """`batch` without its images, and where they now lie; None where the batch has no
        images or no room is left (the call then carries them). `release` the name after
        the call."""
        images = [buffers(job.images) for job in batch.jobs]  # no copies before the one here
        sizes = tuple(tuple(len(image) for image in mine) for mine in images)
        total = sum(sum(s) for s in sizes)
        if not total:
            return None
        segment = self._lend(total)
        if segment is None:
            return None
        at = 0
        for mine in images:
            for image in mine:
                segment.map[at : at + len(image)] = image
                at += len(image)
        jobs = tuple(dataclasses.replace(job, images=()) for job in batch.jobs)
        return dataclasses.replace(batch, jobs=jobs), SharedImages(segment.name, sizes)

    def _lend(self, size: int) -> _Segment | None:
        fits = [s for s in self._free if s.size >= size]
        if fits:
            segment = min(fits, key=lambda s: s.size)
            self._free.remove(segment)
        else:
            size = max(size, MIN_SEGMENT_BYTES)
            while self._free and self._bytes() + size > self._max_bytes:
                self._free.pop().close()  # too small for this call: make room
            if self._bytes() + size > self._max_bytes:
                return None
            try:
                segment = _Segment(size)
            except OSError as exc:
                logger.warning("no shared memory for images (%s); calls carry them", exc)
                return None
        self._lent[segment.name] = segment
        return segment

    def release(self, name: str, reuse: bool = True) -> None:
        """The call that borrowed segment `name` has returned; `reuse=False` where the callee
        could not map it (it is dropped)."""
        segment = self._lent.pop(name)
        if reuse:
            self._free.append(segment)
        else:
            segment.close()

    def close(self) -> None:
        for segment in [*self._free, *self._lent.values()]:
            segment.close()
        self._free.clear()
        self._lent.clear()


class ImageReader:
    """The callee's side: the callers' segments, mapped once and kept (the least recently
    used unmapped past MAPPINGS_KEPT, removed ones once a call comes SWEEP_S after the
    last look)."""

    def __init__(self) -> None:
        self._maps: collections.OrderedDict[str, mmap.mmap] = collections.OrderedDict()
        self._swept = time.monotonic()

    def restore(self, batch: Batch, where: SharedImages) -> Batch:
        """`batch` with its images copied out of the caller's segment."""
        segment = self._map(where.name)
        at = 0
        jobs = []
        for job, sizes in zip(batch.jobs, where.sizes, strict=True):
            images = []
            for size in sizes:
                images.append(segment[at : at + size])
                at += size
            jobs.append(dataclasses.replace(job, images=tuple(images)))
        return dataclasses.replace(batch, jobs=tuple(jobs))

    def _map(self, name: str) -> mmap.mmap:
        if time.monotonic() - self._swept >= SWEEP_S:
            self._drop_removed()
        if name in self._maps:
            self._maps.move_to_end(name)
            return self._maps[name]
        if not _NAME.match(name):
            raise SharedImagesMissing(f"not a raystream image segment: {name[:80]!r}")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY)
        except OSError as exc:
            raise SharedImagesMissing(f"cannot open shared images {name}: {exc}") from None
        try:
            segment = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[name] = segment
        while len(self._maps) > MAPPINGS_KEPT:
            self._maps.popitem(last=False)[1].close()
        return segment

    def _drop_removed(self) -> None:
        """Unmap the segments their writer removed (grown past, dropped after a failed call,
        its replica stopped): a removed file's memory is freed once nobody maps it, and a
        writer never lends a removed name again."""
        self._swept = time.monotonic()
        for name in [name for name in self._maps if not (SHM_DIR / name).exists()]:
            self._maps.pop(name).close()

    def close(self) -> None:
        for segment in self._maps.values():
            segment.close()
        self._maps.clear()


def remove_orphans() -> None:
    """Unlink the segments of processes no longer alive on this node."""
    try:
        names = [p.name for p in SHM_DIR.iterdir()]
    except OSError:
        return
    for name in names:
        found = _NAME.match(name)
        if found and not alive(int(found.group(1))):
            (SHM_DIR / name).unlink(missing_ok=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True
