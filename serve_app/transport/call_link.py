"""The wire under the stage ports (serve_app/transport/stage_port.py): calls between raystream's own
processes as length-prefixed frames over one asyncio connection per caller and replica (TCP,
or the replica's Unix socket where the caller is on its node: serve_app/transport/unix_sockets.py),
many calls in flight on it at once, answered in any order.

Why not gRPC: both ends are raystream, the messages are bytes already
(serve_app/transport/codec.py), and a grpc.aio call is handed between several threads on
each side. A call of 1 KB each way between two Serve
replicas, 4 in flight, on the 2-core CPU machine (`python bench/call_cost.py`): 0.035 ms of
CPU in the two processes together and 0.07 ms p50 here, against 0.53 ms and 1.22 ms for a
grpc.aio unary method (docs/performance.md).

    caller:    b"RSL2" + 32 random bytes (its nonce)
    replica:   32 random bytes (its nonce) + HMAC-SHA256(token, "replica" + both nonces)
    caller:    HMAC-SHA256(token, "caller" + both nonces)   ->   b"\\x01" (or closed)
    a call:    u64 id + u32 images + u64 length + the request bytes
    an answer: u64 id + u64 length + the answer bytes
    a beat:    u64 2**64-1 + u64 0   (every BEAT_S while the replica holds calls)

Both ends prove that they hold the application's stage token, and neither sends it: a
listener at a stale address learns a MAC over nonces it will never see again, and a caller
that replays one meets a fresh nonce. The caller sends nothing after its nonce to a replica
that did not prove itself; the replica reads no call before the caller has. With Ray's TLS
on (`RAY_USE_TLS`), a TCP connection is TLS with Ray's certificates, verified both ways
against Ray's CA (`tls_contexts`); a Unix socket's is not (its bytes never leave the
kernel). `images` is what the call carries (the replica's load: load_board.py). The answer
is whatever the handler returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable, Sequence

from serve_app.tuning import (
    BEAT_S,
    CONNECT_TIMEOUT_S,
    HELLO_TIMEOUT_S,
    KEEPALIVE_IDLE_S,
    KEEPALIVE_INTERVAL_S,
    KEEPALIVE_PROBES,
    SILENT_S,
    UNIX_MIN_SEND_BUFFER_BYTES,
    UNIX_SEND_BUFFER_BYTES,
    USER_TIMEOUT_S,
)

logger = logging.getLogger(__name__)

HELLO = b"RSL2"
ACCEPTED = b"\x01"
NONCE_BYTES = MAC_BYTES = 32
CALL = struct.Struct("<QIQ")  # id, images, length
ANSWER = struct.Struct("<QQ")  # id, length
MAX_FRAME_BYTES = 1 << 30  # calls carry whole batches: tens of MB where requests are large
BEAT_ID = (1 << 64) - 1  # never a call's id: ids count from 0 on each connection

Parts = Sequence[bytes | memoryview]  # a message's bytes, in pieces sent one after another
Handler = Callable[[bytes, int], Awaitable[bytes | Parts]]


class LinkDown(ConnectionError):
    """The connection is gone (the replica stopped, refused the token, or the link was
    closed) before the call's answer came."""


class LinkServer:
    """Serves `handler(request, images) -> answer` to callers that present `token`."""

    def __init__(self, handler: Handler, token: bytes, tls: ssl.SSLContext | None = None) -> None:
        self._handler, self._token, self._tls = handler, token, tls
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.StreamWriter] = set()
        self._calls: set[asyncio.Task] = set()

    async def start(self, host: str, ports: Sequence[int] = (0,)) -> int:
        """Listens on `host`, on the first of `ports` that is free (0: any); returns the
        port. OSError where none is."""
        tls = {"ssl": self._tls, "ssl_handshake_timeout": HELLO_TIMEOUT_S} if self._tls else {}
        for port in ports:
            try:
                server = await asyncio.start_server(self._serve, host, port, **tls)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            self._servers.append(server)
            return server.sockets[0].getsockname()[1]
        raise OSError(errno.EADDRINUSE, f"no free port in {ports[0]}-{ports[-1]} on {host}")

    async def start_unix(self, path: str) -> None:
        """Listens on a Unix socket at `path` too, mode 0600, without TLS: its bytes never
        leave the node's kernel (serve_app/transport/unix_sockets.py)."""
        server = await asyncio.start_unix_server(self._serve, path)
        self._servers.append(server)
        os.chmod(path, 0o600)  # its directory is the user's alone (0700) meanwhile

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        _watch_peer(writer)
        calls: set[asyncio.Task] = set()
        beating: asyncio.Task | None = None
        try:
            if not await self._accepted(reader, writer):
                return
            beating = asyncio.ensure_future(_beat(writer, calls))
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
            if beating is not None:
                beating.cancel()
            for task in calls:  # nobody waits for these answers any more
                task.cancel()
            writer.close()
            self._connections.discard(writer)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Whether the caller proved the token (see the module's doc)."""
        try:
            return await asyncio.wait_for(self._handshake(reader, writer), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError, asyncio.IncompleteReadError):
            return False

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        hello = await reader.readexactly(len(HELLO) + NONCE_BYTES)
        if hello[: len(HELLO)] != HELLO:
            return False
        theirs, ours = hello[len(HELLO) :], secrets.token_bytes(NONCE_BYTES)
        writer.write(ours + _mac(self._token, b"replica", theirs, ours))
        proof = await reader.readexactly(MAC_BYTES)
        if not hmac.compare_digest(proof, _mac(self._token, b"caller", theirs, ours)):
            return False
        writer.write(ACCEPTED)
        return True

    async def stop(self, grace_s: float) -> None:
        """No new connections; calls running get `grace_s` to answer, then are cancelled."""
        if not self._servers:
            return
        for server in self._servers:
            server.close()
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
            await asyncio.wait_for(
                asyncio.gather(*(server.wait_closed() for server in self._servers)), 1.0
            )


async def _beat(writer: asyncio.StreamWriter, calls: set[asyncio.Task]) -> None:
    """A beat every BEAT_S while `calls` run: the caller knows this process still runs."""
    while not writer.transport.is_closing():
        await asyncio.sleep(BEAT_S)
        if calls and not writer.transport.is_closing():
            writer.write(ANSWER.pack(BEAT_ID, 0))


def deployment_key(token: str, deployment: str) -> bytes:
    """The key that one deployment's stage ports prove: a port of another deployment of the
    app (bound since on an address of a replica that stopped) fails the handshake rather
    than run a call meant for another stage."""
    return hmac.new(
        token.encode(), b"stage port of " + deployment.encode(), hashlib.sha256
    ).digest()


def _mac(token: bytes, role: bytes, caller_nonce: bytes, replica_nonce: bytes) -> bytes:
    return hmac.new(token, role + caller_nonce + replica_nonce, hashlib.sha256).digest()


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server, client) contexts from Ray's TLS settings, where Ray's TLS is on: each end
    shows the node's certificate and checks the other's against Ray's CA (Ray's own gRPC
    does the same); None where it is off."""
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return None
    cert, key = os.environ["RAY_TLS_SERVER_CERT"], os.environ["RAY_TLS_SERVER_KEY"]
    ca = os.environ["RAY_TLS_CA_CERT"]
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # node certificates name nodes, not stage ports
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert, key)
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return server, client


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
        parts = (answer,) if isinstance(answer, bytes) else answer
        writer.writelines((ANSWER.pack(call_id, sum(map(len, parts))), *parts))


class Link:
    """Calls to one LinkServer at `address` ("host:port") on one connection, made at the
    first call; `call` raises LinkDown where the connection fails before the answer.

    `unix`: the server's Unix socket, for a server on this node: the connection goes there
    (no TLS: it never leaves the kernel), or to `address` where the socket cannot be reached
    (stale, removed, in another container's /tmp), as every later connection of the link
    does."""

    def __init__(
        self, address: str, token: bytes, tls: ssl.SSLContext | None = None, unix: str = ""
    ) -> None:
        self.address, self._token, self._tls = address, token, tls
        self.unix = unix  # cleared where the socket failed
        self._ids = itertools.count()
        self._answers: dict[int, asyncio.Future[bytes]] = {}
        self._sent_at: dict[int, float] = {}  # call id -> when it was sent (the watch)
        self._heard = 0.0  # when the replica last sent a frame (an answer or a beat)
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._watching: asyncio.Task | None = None
        self._connecting = asyncio.Lock()
        self._closed = False

    async def call(self, request: bytes | Parts, images: int = 0) -> bytes:
        if self._closed:
            raise LinkDown(f"the link to {self.address} is closed")
        writer = self._writer or await self._connect()
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._answers[call_id] = answer
        self._sent_at[call_id] = loop.time()
        try:
            if writer.transport.is_closing():  # lost, and its reader has not seen it yet
                raise LinkDown(f"the link to {self.address} broke")
            # No drain, as for answers; 3.12's writelines needs the check above (gh-136234).
            parts = (request,) if isinstance(request, bytes) else request
            writer.writelines((CALL.pack(call_id, images, sum(map(len, parts))), *parts))
            return await answer
        finally:
            self._answers.pop(call_id, None)
            self._sent_at.pop(call_id, None)
            if not answer.done():
                answer.cancel()
            del answer  # else frame -> future -> exception -> traceback -> frame (the batch)

    async def connect(self) -> None:
        """Connects (and proves the token) now, not at the first call; LinkDown if it fails."""
        if self._closed:
            raise LinkDown(f"the link to {self.address} is closed")
        if self._writer is None:
            await self._connect()

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None:
                return self._writer
            if self._closed:
                raise LinkDown(f"the link to {self.address} is closed")
            host, port = self.address.rsplit(":", 1)
            unreachable = f"cannot reach the stage port {self.address}"
            loop = asyncio.get_running_loop()
            end = loop.time() + CONNECT_TIMEOUT_S

            def deadline() -> float:
                return max(0.0, end - loop.time())

            reader = writer = None
            if self.unix:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_unix_connection(self.unix), deadline()
                    )
                    granted = _grow_send_buffer(writer)
                    if granted < UNIX_MIN_SEND_BUFFER_BYTES:
                        writer.close()
                        reader = writer = None
                        raise OSError(
                            f"a send buffer of {granted} bytes, under "
                            f"{UNIX_MIN_SEND_BUFFER_BYTES} (raise net.core.wmem_max)"
                        )
                except (OSError, asyncio.TimeoutError) as exc:
                    logger.warning(
                        "cannot reach the stage socket %s (%r); calls go to %s by TCP",
                        self.unix,
                        exc,
                        self.address,
                    )
                    self.unix = ""
            if writer is None:
                try:  # a host gone answers nothing: the kernel would retry for minutes
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, int(port), ssl=self._tls), deadline()
                    )
                except (OSError, asyncio.TimeoutError) as exc:
                    raise LinkDown(f"{unreachable}: {exc!r}") from exc
            try:
                accepted = await asyncio.wait_for(self._handshake(reader, writer), deadline())
            except BaseException as exc:  # cancelled too: the socket is not left open
                writer.close()
                if isinstance(exc, OSError | asyncio.IncompleteReadError | asyncio.TimeoutError):
                    raise LinkDown(f"{unreachable}: {exc!r}") from exc
                raise
            if not accepted or self._closed:
                writer.close()
                if self._closed:  # closed while connecting
                    raise LinkDown(f"the link to {self.address} is closed")
                raise LinkDown(
                    f"the stage port {self.address} did not prove this app's stage token, "
                    "or refused this caller's proof"
                )
            _watch_peer(writer)
            self._writer = writer
            self._reading = asyncio.ensure_future(self._read(reader, writer))
            self._watching = asyncio.ensure_future(self._watch(writer))
            return writer

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        ours = secrets.token_bytes(NONCE_BYTES)
        writer.write(HELLO + ours)
        reply = await reader.readexactly(NONCE_BYTES + MAC_BYTES)
        theirs, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(self._token, b"replica", ours, theirs)):
            return False  # not sent our proof: a stranger gets nothing it can use
        writer.write(_mac(self._token, b"caller", ours, theirs))
        return await reader.readexactly(1) == ACCEPTED

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hands each answer to its call; fails every call waiting once the connection ends."""
        reason = "the connection closed"
        try:
            while True:
                call_id, length = ANSWER.unpack(await reader.readexactly(ANSWER.size))
                self._heard = asyncio.get_running_loop().time()
                if call_id == BEAT_ID:
                    continue
                answer = await reader.readexactly(length)
                self._heard = asyncio.get_running_loop().time()
                waiting = self._answers.get(call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        except (asyncio.IncompleteReadError, OSError) as exc:
            reason = str(exc) or reason
        finally:
            if self._writer in (writer, None):  # not a connection made since
                self._fail_all(f"the link to {self.address} broke: {reason}")

    async def _watch(self, writer: asyncio.StreamWriter) -> None:
        """Drops the connection once a call has waited SILENT_S with nothing heard from the
        replica (see SILENT_S); time spent still sending a call does not count."""
        loop = asyncio.get_running_loop()
        sending = 0.0  # when a call was last seen still being sent
        while self._writer is writer:
            await asyncio.sleep(BEAT_S / 2)
            now = loop.time()
            if writer.transport.get_write_buffer_size():
                sending = now
            if not self._sent_at:
                continue
            silent = now - max(self._heard, sending, min(self._sent_at.values()))
            if silent > SILENT_S and self._writer is writer:
                logger.warning("the stage port %s sent nothing for %.1f s", self.address, silent)
                self._fail_all(f"the stage port {self.address} sent nothing for {silent:.1f} s")
                return

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
        if self._watching is not None:
            self._watching.cancel()
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        self._fail_all(f"the link to {self.address} was closed")


def _watch_peer(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive and a user timeout on a TCP connection (see KEEPALIVE_IDLE_S; options
    the platform lacks are skipped); a Unix socket's send buffer grown instead."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    if sock.family == socket.AF_UNIX:  # its peer cannot vanish unseen: its kernel is this one
        _grow_send_buffer(writer)
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


def _grow_send_buffer(writer: asyncio.StreamWriter) -> int:
    """Asks for UNIX_SEND_BUFFER_BYTES of send buffer; the bytes granted."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
