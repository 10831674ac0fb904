"""At most N processes of a host decoding JPEGs on one GPU at once.

Each GPU Inference replica decodes on its own thread, and on an H200 the more processes
decode at once, the more CPU an image costs: calls of 64 photos decoded and cropped by 12
processes at once cost 0.75 ms of CPU an image, by 4 processes 0.27, by one 0.14, and 12
decoded no more images a second than 4 (`bench/decode_procs.py`, docs/performance.md).
The slots are lock files (`flock`), and the kernel frees a slot whose holder dies, so a
crashed replica never keeps one. Processes queue for them on one more lock file, asleep;
the first in the queue takes the first free slot, and while none is, it alone looks again
every POLL_S (a few syscalls), asleep in between: whichever slot frees first goes to the
process at the head of the queue, never to one that came later.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# How often the first waiting process looks for a free slot: a decode call of 64 JPEGs
# takes milliseconds.
POLL_S = 0.00025


def gpu_slots(count: int, device: str = "cuda") -> DecodeSlots | None:
    """`count` slots for the GPU `device` names, shared by every process of this host that
    decodes on that GPU (its folder is named by the GPU's UUID: CUDA_VISIBLE_DEVICES numbers
    GPUs differently in each Ray worker). None for 0 (no limit)."""
    if not count:
        return None
    import torch  # GPU hosts only

    uuid = torch.cuda.get_device_properties(torch.device(device)).uuid
    return DecodeSlots(Path(tempfile.gettempdir()) / "raystream-decode-slots" / str(uuid), count)


class DecodeSlots:
    """`count` slots in `folder`, shared with every process that opens the same folder
    with the same count. A process holds at most one slot at a time: its threads take
    turns (a lock file locked twice through one open file is still one lock; torchvision
    decodes one call at a time per process anyway)."""

    def __init__(self, folder: Path, count: int) -> None:
        if count < 1:
            raise ValueError(f"decode slots must be at least 1, got {count}")
        folder.mkdir(parents=True, exist_ok=True)
        self.count = count
        # file objects, not bare descriptors: dropped with the decoder (a model version
        # unloaded), they close, and a slot held through one is freed
        self._files = [open(folder / f"slot-{i}", "ab") for i in range(count)]  # noqa: SIM115
        self._queue = open(folder / "queue", "ab")  # noqa: SIM115
        self._one_thread = threading.Lock()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold a slot for the block: the first free one, in turn (see the module)."""
        with self._one_thread:
            fcntl.flock(self._queue.fileno(), fcntl.LOCK_EX)  # the others queue, asleep
            try:
                while (taken := self._free_slot()) is None:
                    time.sleep(POLL_S)
            finally:
                fcntl.flock(self._queue.fileno(), fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(taken, fcntl.LOCK_UN)

    def _free_slot(self) -> int | None:
        """A slot this process now holds (its descriptor), or None: all were taken."""
        return next((f.fileno() for f in self._files if _try_lock(f.fileno())), None)

    def close(self) -> None:
        for file in [*self._files, self._queue]:
            file.close()
        self._files = []


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
