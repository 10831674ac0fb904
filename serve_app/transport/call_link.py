"""The wire under the stage ports (serve_app/transport/stage_port.py): calls between raystream's own
processes as length-prefixed frames over one asyncio TCP connection per caller and replica,
many calls in flight on it at once, answered in any order.

Why not gRPC: both ends are raystream, the messages are pickles, and a grpc.aio call is
handed between several threads on each side. A call of 1 KB each way between two Serve
replicas, 4 in flight, on the 2-core CPU machine (`python bench/call_cost.py`): 0.035 ms of
CPU in the two processes together and 0.07 ms p50 here, against 0.53 ms and 1.22 ms for a
grpc.aio unary method (docs/performance.md).

    connect:   b"RSL1" + u32 token length + token   ->   b"\\x01" (or b"\\x00", closed)
    a call:    u64 id + u32 images + u64 length + the request bytes
    an answer: u64 id + u64 length + the answer bytes

A connection's first frame is the application's stage token; the replica reads nothing else
before it has checked it (a call is a pickle, and unpickling runs code). `images` is what
the call carries (the replica's load: load_board.py). The answer is whatever the handler
returned: the stage port's pickled (ok, value).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import socket
import struct
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

HELLO = b"RSL1"
ACCEPTED, REFUSED = b"\x01", b"\x00"
CALL = struct.Struct("<QIQ")  # id, images, length
ANSWER = struct.Struct("<QQ")  # id, length
MAX_FRAME_BYTES = 1 << 30  # calls carry whole batches: tens of MB where requests are large
MAX_TOKEN_BYTES = 1 << 10
HELLO_TIMEOUT_S = 10.0  # to connect, and to present or check the token
# A peer whose host vanished (power, network) sends no reset: without these, calls waiting on
# its connection would wait until its address left the registry and its links closed (up to
# ~36 s). Idle for KEEPALIVE_IDLE_S, the kernel probes every KEEPALIVE_INTERVAL_S and drops
# the connection after KEEPALIVE_PROBES unanswered; data unacknowledged for USER_TIMEOUT_S
# drops it too. Either way the calls fail with LinkDown and go by handle.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3
USER_TIMEOUT_S = 10

Handler = Callable[[bytes, int], Awaitable[bytes]]


class LinkDown(ConnectionError):
    """The connection is gone (the replica stopped, refused the token, or the link was
    closed) before the call's answer came."""


class LinkServer:
    """Serves `handler(request, images) -> answer` to callers that present `token`."""

    def __init__(self, handler: Handler, token: bytes) -> None:
        self._handler, self._token = handler, token
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._calls: set[asyncio.Task] = set()

    async def start(self, host: str) -> int:
        """Listens on `host`, on a free port; returns the port."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        _watch_peer(writer)
        calls: set[asyncio.Task] = set()
        try:
            if not await self._accepted(reader, writer):
                return
            while True:
                try:
                    call_id, images, length = CALL.unpack(await reader.readexactly(CALL.size))
                except asyncio.IncompleteReadError:
                    return  # the caller closed
                if length > MAX_FRAME_BYTES:
                    logger.warning("a stage call of %d bytes: the link is closed", length)
                    return
                request = await reader.readexactly(length)
                task = asyncio.ensure_future(
                    _answer(self._handler(request, images), call_id, writer)
                )
                for group in (calls, self._calls):
                    group.add(task)
                    task.add_done_callback(group.discard)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for task in calls:  # nobody waits for these answers any more
                task.cancel()
            writer.close()
            self._connections.discard(writer)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            token = await asyncio.wait_for(_token(reader), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError, asyncio.IncompleteReadError):
            return False
        if token is None:
            return False
        ok = hmac.compare_digest(token, self._token)
        writer.write(ACCEPTED if ok else REFUSED)
        if not ok:
            await writer.drain()
        return ok

    async def stop(self, grace_s: float) -> None:
        """No new connections; calls running get `grace_s` to answer, then are cancelled."""
        if self._server is None:
            return
        self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        # calls that arrive meanwhile are served too (callers learn of the stop a poll later)
        while self._calls and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._calls), timeout=left)
        for task in self._calls:
            task.cancel()
        for writer in self._connections:  # each connection's reader ends, and its handler
            writer.close()
        with contextlib.suppress(asyncio.TimeoutError):  # 3.12: waits for those handlers
            await asyncio.wait_for(self._server.wait_closed(), 1.0)


async def _token(reader: asyncio.StreamReader) -> bytes | None:
    """The token a connection opens with; None if it does not open as a link does."""
    magic, size = await reader.readexactly(4), await reader.readexactly(4)
    length = int.from_bytes(size, "little")
    if magic != HELLO or length > MAX_TOKEN_BYTES:
        return None
    return await reader.readexactly(length)


async def _answer(running: Awaitable[bytes], call_id: int, writer: asyncio.StreamWriter) -> None:
    try:
        answer = await running
    except Exception:  # a handler must answer: the link breaks, and its callers go elsewhere
        logger.exception("a stage call raised; its link is closed")
        writer.close()
        return
    # No drain: the frame is in memory already, and the calls in flight bound the frames.
    # Python 3.12's writelines does not check for a lost connection itself (gh-136234).
    if not writer.transport.is_closing():  # else the caller went: nobody to answer
        writer.writelines((ANSWER.pack(call_id, len(answer)), answer))


class Link:
    """Calls to one LinkServer at `address` ("host:port") on one connection, made at the
    first call; `call` raises LinkDown where the connection fails before the answer."""

    def __init__(self, address: str, token: bytes) -> None:
        self.address, self._token = address, token
        self._ids = itertools.count()
        self._answers: dict[int, asyncio.Future[bytes]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._connecting = asyncio.Lock()
        self._closed = False

    async def call(self, request: bytes, images: int = 0) -> bytes:
        if self._closed:
            raise LinkDown(f"the link to {self.address} is closed")
        writer = self._writer or await self._connect()
        call_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._answers[call_id] = answer
        try:
            if writer.transport.is_closing():  # lost, and its reader has not seen it yet
                raise LinkDown(f"the link to {self.address} broke")
            # No drain, as for answers; 3.12's writelines needs the check above (gh-136234).
            writer.writelines((CALL.pack(call_id, images, len(request)), request))
            return await answer
        finally:
            self._answers.pop(call_id, None)
            if not answer.done():
                answer.cancel()
            del answer  # else frame -> future -> exception -> traceback -> frame (the batch)

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None:
                return self._writer
            if self._closed:
                raise LinkDown(f"the link to {self.address} is closed")
            host, port = self.address.rsplit(":", 1)
            unreachable = f"cannot reach the stage port {self.address}"
            try:  # a host gone answers nothing: the kernel would retry for minutes
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port)), HELLO_TIMEOUT_S
                )
            except (OSError, asyncio.TimeoutError) as exc:
                raise LinkDown(f"{unreachable}: {exc!r}") from exc
            try:
                writer.write(HELLO + len(self._token).to_bytes(4, "little") + self._token)
                reply = await asyncio.wait_for(reader.readexactly(1), HELLO_TIMEOUT_S)
                accepted = reply == ACCEPTED
            except BaseException as exc:  # cancelled too: the socket is not left open
                writer.close()
                if isinstance(exc, OSError | asyncio.IncompleteReadError | asyncio.TimeoutError):
                    raise LinkDown(f"{unreachable}: {exc!r}") from exc
                raise
            if not accepted or self._closed:
                writer.close()
                if self._closed:  # closed while connecting
                    raise LinkDown(f"the link to {self.address} is closed")
                raise LinkDown(f"the stage port {self.address} refused this app's stage token")
            _watch_peer(writer)
            self._writer = writer
            self._reading = asyncio.ensure_future(self._read(reader))
            return writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Hands each answer to its call; fails every call waiting once the connection ends."""
        reason = "the connection closed"
        try:
            while True:
                call_id, length = ANSWER.unpack(await reader.readexactly(ANSWER.size))
                answer = await reader.readexactly(length)
                waiting = self._answers.get(call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        except (asyncio.IncompleteReadError, OSError) as exc:
            reason = str(exc) or reason
        finally:
            self._fail_all(f"the link to {self.address} broke: {reason}")

    def _fail_all(self, reason: str) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        for waiting in self._answers.values():
            if not waiting.done():
                waiting.set_exception(LinkDown(reason))

    async def close(self, grace_s: float = 0.0) -> None:
        """No new calls; calls in flight get `grace_s` to be answered, then fail (LinkDown)."""
        self._closed = True
        waiting = [answer for answer in self._answers.values() if not answer.done()]
        if waiting and grace_s > 0:
            await asyncio.wait(waiting, timeout=grace_s)
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        self._fail_all(f"the link to {self.address} was closed")


def _watch_peer(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive and a user timeout on the connection (see KEEPALIVE_IDLE_S); options
    the platform lacks are skipped."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = [
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000),
    ]
    for name, value in options:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
