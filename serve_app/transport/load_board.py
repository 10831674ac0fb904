"""How busy each stage replica on this node is, for its callers: the images its own stages
hold (received over its stage port, not yet passed on), published in shared memory.

A caller (serve_app/transport/stage_port.py, PortCalls) picks the replica for each call.
Its own calls in flight tell it nothing of the other callers' (six ingress replicas share
twelve Inference replicas in `deploy/serve_config.gpu.yaml`), so two callers can load one
replica while another idles, and the request that waits behind them sets the latency tail.
Each stage port therefore writes the images it holds into a small file in /dev/shm named by
its address (LoadSlot), counted as a call arrives (its frame names its images:
serve_app/transport/call_link.py), before it is unpickled; a caller on the same node maps it
and reads it at each pick (LoadBoard), a few hundred nanoseconds. Replicas on other nodes
publish nowhere the caller can read: where the candidates span nodes, the caller counts its
own images in flight only.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from pathlib import Path

from serve_app.transport.shared_images import SHM_DIR, alive

logger = logging.getLogger(__name__)

PREFIX = "raystream-load-"
_LAYOUT = struct.Struct("<qq")  # the publishing process' pid, the images it holds


def slot_name(address: str) -> str:
    """The file a stage port at `address` ("host:port") publishes its load in."""
    return PREFIX + address.replace(":", "_").replace("[", "").replace("]", "")


class LoadSlot:
    """The callee's side: `add(images)` as calls arrive, `add(-images)` as they are answered.
    Without shared memory (a full /dev/shm, another platform) it still counts, unread."""

    def __init__(self, address: str) -> None:
        self.images = 0
        self._map: mmap.mmap | None = None
        self._path = SHM_DIR / slot_name(address)
        remove_orphans()
        try:
            self._map = _publish(self._path)
        except OSError as exc:
            logger.warning("cannot publish this stage port's load (%s)", exc)

    def add(self, images: int) -> None:
        self.images += images
        if self._map is not None:
            _LAYOUT.pack_into(self._map, 0, os.getpid(), self.images)

    def close(self) -> None:
        """The port is stopped: it holds nothing (a caller still mapping the file reads 0)."""
        if self._map is not None:
            _LAYOUT.pack_into(self._map, 0, os.getpid(), 0)
            self._map.close()
            self._map = None
            self._path.unlink(missing_ok=True)


def _publish(path: Path) -> mmap.mmap:
    """A new file at `path` holding this process' pid and 0 images, mapped. Made aside and
    moved into place: a caller mapping an earlier file there keeps reading that one; and
    its memory is reserved first, so a full /dev/shm fails here, not as SIGBUS later."""
    aside = path.with_name(f"{path.name}.{os.getpid()}.new")
    fd = os.open(aside, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, _LAYOUT.size)
        slot = mmap.mmap(fd, _LAYOUT.size)
        _LAYOUT.pack_into(slot, 0, os.getpid(), 0)
        os.replace(aside, path)
        return slot
    except BaseException:
        aside.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


class LoadBoard:
    """The caller's side: `images(address)` a replica on this node holds now, or None where
    it publishes none here (another node, or not started yet: asked again next time). A
    file stays mapped until `forget` or `close`: the caller closes the board at each read of
    the replicas' addresses, so a new replica on a stopped one's address is read within it."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def images(self, address: str) -> int | None:
        board = self._maps.get(address)
        if board is None:
            board = self._open(address)
            if board is None:
                return None
        return _LAYOUT.unpack_from(board, 0)[1]

    def _open(self, address: str) -> mmap.mmap | None:
        try:
            fd = os.open(SHM_DIR / slot_name(address), os.O_RDONLY)
        except OSError:
            return None
        try:
            board = mmap.mmap(fd, _LAYOUT.size, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # a file shorter than the layout: being made
            return None
        finally:
            os.close(fd)
        self._maps[address] = board
        return board

    def forget(self, address: str) -> None:
        """The address is gone (its replica stopped); a new replica there is mapped anew."""
        board = self._maps.pop(address, None)
        if board is not None:
            board.close()

    def close(self) -> None:
        for address in list(self._maps):
            self.forget(address)


def remove_orphans() -> None:
    """Unlink the slots of processes no longer alive on this node."""
    try:
        paths = [p for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return
    for path in paths:
        try:
            pid, _ = _LAYOUT.unpack(path.read_bytes()[: _LAYOUT.size])
        except (OSError, struct.error):
            continue
        if not alive(pid):
            path.unlink(missing_ok=True)
