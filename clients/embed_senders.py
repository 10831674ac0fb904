"""Sender processes for one embedding job (`raystream embed --senders N`): a GPU server
answers faster than one Python process can read files, build requests and parse vectors,
so the job can run N child processes that send, each over connections of its own, while this
process keeps the one ShardStore (clients/shard_store.py) and its commits.

This process reads the list of images once and hands each image not committed yet to one
child: child i gets those whose ordinal is i modulo N. Only this process writes the output
folder, so a job killed at any point and run again (with any N) still ends with every image
exactly once. A child runs the same EmbedJob as one process does (retries, backoff, failures
listed), with a store that forwards each image's vector or failure here instead of writing it.

Nothing is pickled: this process writes a child's settings on its stdin as JSON (each message
after its length), then its images, as JSON lists of up to FEED_ROWS [ordinal, key, path],
and closes it when the list ends. The child answers in frames on its stdout, each a JSON
header (the images embedded and the images failed, or the error that ends the child) and the
embedded images' vectors as raw bytes. The images go out in the list's order and a child reads
little ahead, so no child runs far ahead of the slowest: the images committed out of order
(the state's `done_above`) stay few. A child dies with its parent (PR_SET_PDEATHSIG), and a
child that fails ends the job: what arrived is committed, and its error is the job's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import BinaryIO

import numpy as np

from clients.catalog_errors import CatalogError
from clients.catalog_inputs import CatalogItem
from clients.shard_store import ShardStore

logger = logging.getLogger(__name__)

FRAME = struct.Struct("<II")  # a child's frame: the header's bytes, the vectors' bytes
SIZE = struct.Struct("<I")  # the parent's: the JSON's bytes
FLUSH_ROWS = 256  # a child sends what it has every FLUSH_ROWS images or FLUSH_SECONDS
FLUSH_SECONDS = 0.05
# A frame of images to a child: up to FEED_ROWS, ending before FEED_CHARS of keys and paths
# (or one image, however long). A child reads at most 128 KiB ahead (asyncio pauses the pipe
# there): with the pipes' and the requests in flight, it stays a few thousand images ahead
# of the slowest at most, so the images done out of order stay few.
FEED_ROWS = 64
FEED_CHARS = 1 << 15
CHILD_FAILED = 3  # a child's exit code after an error it sent in its last frame
PARENT_PID = "RAYSTREAM_EMBED_PARENT"  # the environment variable a child checks its parent by


class SenderFailed(CatalogError):
    """A sender process failed; what the others embedded is committed."""


# -- this process: the job ---------------------------------------------------------------


class SenderPool:
    """`senders` child processes that embed `items` (the inputs' list, read here once) into
    `store` (EmbedJob's counters and `run`). `job`: what each child needs besides its
    images: server, model, batch_size, in_flight, attempts, fp16, connections and
    client_options."""

    def __init__(
        self,
        store: ShardStore,
        items: Iterable[CatalogItem],
        senders: int,
        job: dict,
        *,
        commit_seconds: float = 300.0,
        on_progress: Callable[[int], None] = lambda n: None,
    ) -> None:
        self._store = store
        self._items = items
        self._senders = senders
        self._job = job
        self._commit_seconds = commit_seconds
        self._on_progress = on_progress
        self.embedded = 0
        self.failed = 0

    async def run(self) -> None:
        # the children import what this process imports, wherever it found it
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
            PARENT_PID: str(os.getpid()),
        }
        children: list[asyncio.subprocess.Process] = []
        tasks: list[asyncio.Future] = []
        feeding: asyncio.Future | None = None
        try:
            for _ in range(self._senders):
                child = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "clients.embed_senders",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=env,
                    start_new_session=True,  # Ctrl-C reaches this process; it stops them
                )
                children.append(child)
                child.stdin.write(_framed(self._job))
            tasks = [asyncio.ensure_future(self._receive(child)) for child in children]
            feeding = asyncio.ensure_future(self._feed(children))
            for finished in asyncio.as_completed([*tasks, feeding]):
                await finished  # the first child to fail (or the list) ends the job
        finally:
            if feeding is not None:
                feeding.cancel()
                tasks.append(feeding)
            for child in children:
                if child.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.kill()
            # the others' frames up to the kill are kept; their errors after it are not news
            await asyncio.gather(*tasks, *(c.wait() for c in children), return_exceptions=True)
            self._store.commit()

    async def _feed(self, children: list[asyncio.subprocess.Process]) -> None:
        """The images not committed yet, each to child ordinal % N, in the list's order; then
        end of file to each. Waits while a child's pipe is full, so the others wait too. A
        child gone stops the feeding: its own task reports why."""
        lines: list[list] = [[] for _ in children]
        sizes = [0] * len(children)  # the bytes of keys and paths in each line
        try:
            for listed, item in enumerate(self._items):
                if listed % 10_000 == 0:
                    await asyncio.sleep(0)  # a long list of committed images: others run
                if self._store.is_done(item.ordinal):
                    continue
                i = item.ordinal % len(children)
                size = len(item.key) + len(item.path)
                if lines[i] and sizes[i] + size > FEED_CHARS:
                    await _send(children[i], lines[i])
                    lines[i], sizes[i] = [], 0
                lines[i].append((item.ordinal, item.key, item.path))
                sizes[i] += size
                if len(lines[i]) >= FEED_ROWS:
                    await _send(children[i], lines[i])
                    lines[i], sizes[i] = [], 0
            for child, line in zip(children, lines, strict=True):
                if line:
                    await _send(child, line)
                child.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            # A sender gone: its own task says why; the others end their shares as they
            # stand, and the job, incomplete, says so.
            for child in children:
                child.stdin.close()

    async def _receive(self, child: asyncio.subprocess.Process) -> None:
        """Frames from one child into the store, until it exits."""
        last_words: deque[str] = deque(maxlen=1)
        stderr = asyncio.ensure_future(_relay(child.stderr, last_words))
        cut = False  # its output ended inside a frame
        try:
            failed = await self._frames(child)
        except asyncio.IncompleteReadError:
            failed, cut = "", True
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                child.kill()  # else it waits on a full pipe for ever
            raise
        finally:
            code = await child.wait()
            await stderr
        if failed:
            raise SenderFailed(failed)
        if code != 0 or cut:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            how += ", in the middle of a frame" if cut else ""
            said = f"; its last words: {last_words[0]}" if last_words else ""
            raise SenderFailed(f"a sender process failed ({how}){said}")

    async def _frames(self, child: asyncio.subprocess.Process) -> str:
        """Until the child's last frame; the error that ended it, if one did."""
        frames = child.stdout
        while True:
            try:
                sizes = await frames.readexactly(FRAME.size)
            except asyncio.IncompleteReadError as end:
                if end.partial:
                    raise
                return ""  # its output ended between frames
            header_bytes, vector_bytes = FRAME.unpack(sizes)
            header = json.loads(await frames.readexactly(header_bytes))
            if "error" in header:
                return header["error"]
            vectors = np.frombuffer(await frames.readexactly(vector_bytes), header["dtype"])
            vectors = vectors.reshape(len(header["embedded"]), self._store.job.dim)
            for (ordinal, key), vector in zip(header["embedded"], vectors, strict=True):
                self._store.add(ordinal, key, vector)
            for ordinal, key, path, code, message in header["failed"]:
                self._store.fail(ordinal, key, path, code, message)
            self.embedded += len(header["embedded"])
            self.failed += len(header["failed"])
            self._on_progress(len(header["embedded"]) + len(header["failed"]))
            if self._store.seconds_open >= self._commit_seconds:
                self._store.commit()


async def _send(child: asyncio.subprocess.Process, message: object) -> None:
    child.stdin.write(_framed(message))
    await child.stdin.drain()


def _framed(message: object) -> bytes:
    data = json.dumps(message).encode()
    return SIZE.pack(len(data)) + data


async def _read_framed(stream: asyncio.StreamReader) -> object:
    """The next message written by _framed; EOFError at the end of the stream."""
    try:
        (size,) = SIZE.unpack(await stream.readexactly(SIZE.size))
        return json.loads(await stream.readexactly(size))
    except asyncio.IncompleteReadError as end:
        if end.partial:
            raise
        raise EOFError from None


async def _relay(stream: asyncio.StreamReader, last_words: deque[str]) -> None:
    """A child's stderr (its warnings) to this process', its last line kept for a crash."""
    while chunk := await stream.read(1 << 16):
        text = chunk.decode(errors="replace")
        sys.stderr.write(text)
        if lines := text.strip().splitlines():
            last_words.append(lines[-1])


# -- a child: one share of the job ------------------------------------------------------


class _ForwardingStore:
    """What EmbedJob needs of a store, sending each image's outcome to the parent: in frames
    of up to FLUSH_ROWS images, at least every FLUSH_SECONDS (EmbedJob commits as often)."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._embedded: list[tuple[int, str]] = []
        self._vectors: list[np.ndarray] = []
        self._failed: list[tuple[int, str, str, str, str]] = []
        self._sent = time.monotonic()

    def is_done(self, ordinal: int) -> bool:
        return False  # the parent hands out only the images not done

    def add(self, ordinal: int, key: str, vector: np.ndarray) -> None:
        self._embedded.append((ordinal, key))
        self._vectors.append(vector)
        if len(self._embedded) + len(self._failed) >= FLUSH_ROWS:
            self.commit()

    def fail(self, ordinal: int, key: str, path: str, code: str, message: str) -> None:
        self._failed.append((ordinal, key, path, code, message))
        if len(self._embedded) + len(self._failed) >= FLUSH_ROWS:
            self.commit()

    @property
    def seconds_open(self) -> float:
        return time.monotonic() - self._sent

    def commit(self) -> None:
        if self._embedded or self._failed:
            vectors = np.stack(self._vectors) if self._vectors else np.zeros(0, np.float32)
            header = {
                "embedded": self._embedded,
                "failed": self._failed,
                "dtype": vectors.dtype.str,
            }
            header = json.dumps(header).encode()
            self._out.write(FRAME.pack(len(header), vectors.nbytes) + header + vectors.tobytes())
            self._out.flush()
            self._embedded, self._vectors, self._failed = [], [], []
        self._sent = time.monotonic()


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), as a killed job's children must;
    exits now if the parent died before this was armed."""
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig, sigkill = 1, 9
        ctypes.CDLL("libc.so.6").prctl(pr_set_pdeathsig, sigkill)
    if os.environ.get(PARENT_PID, str(os.getppid())) != str(os.getppid()):
        sys.exit(CHILD_FAILED)


async def _send_share(out: BinaryIO) -> None:
    """The settings, then the images, from stdin (the parent); their outcomes to `out`."""
    from clients.client import Client
    from clients.embed_job import EmbedJob

    loop = asyncio.get_running_loop()
    parent = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(parent), sys.stdin)
    settings = await _read_framed(parent)
    store = _ForwardingStore(out)
    job = EmbedJob(
        store,
        _handed_out(parent),
        model=settings["model"],
        batch_size=settings["batch_size"],
        in_flight=settings["in_flight"],
        attempts=settings["attempts"],
        commit_seconds=FLUSH_SECONDS,
        fp16=settings["fp16"],
    )
    options = settings["client_options"]
    async with Client(settings["server"], connections=settings["connections"], **options) as c:
        await job.run(c.stream)
    store.commit()
    if not parent.at_eof():  # never, unless EmbedJob stops before its source ends
        raise CatalogError("a sender stopped before it had sent every image handed to it")


async def _handed_out(parent: asyncio.StreamReader) -> AsyncIterator[CatalogItem]:
    while True:
        try:
            images = await _read_framed(parent)
        except EOFError:
            return
        for ordinal, key, path in images:
            yield CatalogItem(ordinal, key, path)


def main() -> int:
    import grpc

    from clients.embed_command import reuse_freed_memory

    _die_with_parent()
    reuse_freed_memory()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # the frames get stdout's pipe to themselves; anything else printed goes to stderr
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        asyncio.run(_send_share(out))
    except (CatalogError, grpc.aio.AioRpcError) as exc:
        error = str(exc) if isinstance(exc, CatalogError) else f"{exc.code().name}: {exc.details()}"
        header = json.dumps({"error": error}).encode()
        out.write(FRAME.pack(len(header), 0) + header)
        out.flush()
        return CHILD_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
