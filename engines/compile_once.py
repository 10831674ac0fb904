"""One process of a host compiles each shape of a model; the others read inductor's cache.

`torch.compile`'s first pass at a new batch size traces, generates and builds Triton kernels:
on a host whose inductor cache is empty, tens of seconds, with a pool of compile workers as
large as the host's cores. The replicas of a deployment start together, so a dozen of them
used to do the same work at once, each slowing the others and the replicas already serving.
Inductor's caches (FX graphs, AOTAutograd, Triton kernels) live on the host's disk and are
shared by its processes; so the first process to reach a shape compiles it alone, under a
file lock beside that cache, and leaves a mark. The others wait for the mark, then compile
from the cache in seconds. A process that dies holding the lock releases it (flock), and a
failed compile leaves no mark: the next process tries on its own.

The mark only says that waiting is over, never that the cache holds the kernels: a cache
emptied since is a slower compile, never a wrong one.

Compiling from the cache still traces the model: seconds of a core per shape and process.
Replicas that compile while they serve (torch-CUDA's `compile_after_ready`) pass `at_once`,
so that at most that many processes of the host do it at a time, and the cores the others
serve with stay theirs.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def compile_key(*parts: object) -> str:
    """A short name for what is compiled: the program, torch's version, the GPU, the
    precision and the batch size, as the caller lists them."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def compile_once(
    key: str, compile: Callable[[], T], folder: Path | None = None, at_once: int = 0
) -> T:
    """`compile()` (a compiled function's first pass at one shape), which the host's first
    process to get here runs alone; the others run it once that one is done, from its cache,
    at most `at_once` of them at a time where it is above 0.
    `folder`: where the locks and marks live (default: inductor's cache folder)."""
    folder = Path(folder) if folder is not None else _inductor_cache() / "raystream-compiled"
    mark = folder / f"{key}.done"
    if mark.exists():
        with _turn(folder, at_once):
            return compile()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{key}.lock", "a") as lock:
        waited = time.perf_counter()
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if mark.exists():
                logger.info(
                    "another process compiled this shape: waited %.1f s for it",
                    time.perf_counter() - waited,
                )
            else:
                result = compile()
                mark.touch()
                return result
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    with _turn(folder, at_once):
        return compile()  # from the cache that process filled


@contextmanager
def _turn(folder: Path, at_once: int, poll_s: float = 0.05) -> Iterator[None]:
    """One of `at_once` turns shared by the host's processes (flocks on as many files in
    `folder`), waited for; nothing to wait for where `at_once` is 0."""
    if at_once <= 0:
        yield
        return
    with ExitStack() as files:
        turns = [files.enter_context(open(folder / f"turn-{i}.lock", "a")) for i in range(at_once)]
        waited = time.perf_counter()
        while True:
            for turn in turns:
                try:
                    fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                if (seconds := time.perf_counter() - waited) >= 1.0:
                    logger.info("waited %.1f s for a turn to compile from the cache", seconds)
                try:
                    yield
                finally:
                    fcntl.flock(turn, fcntl.LOCK_UN)
                return
            time.sleep(poll_s)


def _inductor_cache() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())
