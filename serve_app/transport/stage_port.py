"""Stage calls over a TCP port of each stage replica's own (`stage_ports`), beside
Serve's handles.

A Serve handle call costs its two processes about twice a plain Ray actor call, and about
2.5 times the same bytes sent over a grpc.aio channel between the same two replicas, which
costs several times a call over raystream's own framed link
(serve_app/transport/call_link.py; `python bench/call_cost.py` measures all four). The
stages' calls carry whole micro-batches, but at small batches (one-image requests, low
load) those costs are a large part of an image's CPU and latency. So, with `stage_ports`,
each stage replica also serves its `run` on a port of its own (StagePort) and
reports the address with its models in the registry (serve_app/models/registry.py); a
caller (PortCalls) sends each batch (as bytes of serve_app/transport/codec.py, never a
pickle) to the least busy replica of the next deployment among those that report holding
the batch's model version (by the images each holds for all its callers where they are all
on the caller's node: serve_app/transport/load_board.py), the images in it through shared
memory where that replica is on the caller's node (serve_app/transport/shared_images.py). A
replica that has started since a version was loaded, and loads it still, then takes no
request for it.

Serve still places, starts, scales, stops and health-checks the replicas; the handles still
carry everything else (what is served, model lifecycle). A call goes by handle when
the caller knows no address yet, and again by handle when the port fails before answering
(the replica stopped: the address is dropped until its next report). The stages have no
side effects, so a batch run twice is harmless. Calls over the port are not Serve requests:
the port itself refuses a call while its replica holds the deployment's
`max_ongoing_requests` calls (StageBusy; the caller tries another replica, else the handle),
and Serve's autoscaler sees them only through raystream's policy
(serve_app/pipeline/autoscaling.py), to which every replica reports the port's calls in its
own stages. The port binds the node's address that Ray uses, and a Unix socket that callers
on the replica's node (by Ray node id) use instead (serve_app/transport/unix_sockets.py);
both ends of a connection prove that they hold the application's stage token (a random secret that
build_app gives every replica) without sending it, and the replica reads no call before
(serve_app/transport/call_link.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from serve_app.core.messages import Batch
from serve_app.errors import Code, StageBusy, cancelled_itself, code_for
from serve_app.models.registry import ModelRegistry
from serve_app.observability.metrics import StageCallMetrics
from serve_app.transport import codec, device_crops
from serve_app.transport.call_link import (
    Link,
    LinkDown,
    LinkServer,
    deployment_key,
    tls_contexts,
)
from serve_app.transport.load_board import LoadBoard, LoadSlot
from serve_app.transport.shared_images import ImageReader, ImageWriter, SharedImagesMissing
from serve_app.transport.unix_sockets import new_socket_path
from serve_app.tuning import ADDRESS_POLL_S, CLOSE_GRACE_S, FIRST_BACKOFF_S, MAX_BACKOFF_S

logger = logging.getLogger(__name__)


class StagePort:
    """A stage replica's own port for stage calls (serve_app/transport/call_link.py):
    `run(batch)` on its loop, then `then(result)` (the call to the next group) where given;
    the images a call brings count as this replica's load (serve_app/transport/load_board.py)
    while `run` has them.

    `max_calls()`: the deployment's `max_ongoing_requests` now; a call that arrives while the
    replica holds that many (over the port, and by handle as `handle_calls()` counts them)
    is refused at once with StageBusy, and its caller sends it elsewhere. 0: no bound."""

    def __init__(
        self,
        run: Callable[[Batch], Awaitable[Any]],
        token: str,
        deployment: str,
        then: Callable[[Any], Awaitable[Any]] | None = None,
        max_calls: Callable[[], int] = lambda: 0,
        handle_calls: Callable[[], int] = lambda: 0,
    ) -> None:
        self._run, self._then = run, then
        self._token = deployment_key(token, deployment)
        self._deployment = deployment
        self._max_calls, self._handle_calls = max_calls, handle_calls
        self._server: LinkServer | None = None
        self._images = ImageReader()
        self._load: LoadSlot | None = None  # the images held, for callers on this node
        self.address = ""
        self.unix = ""  # the Unix socket's path, for callers on this node ("": none)
        self.calls = 0  # calls answered (tests: the port, not the handle, carried them)
        self.in_flight = 0  # calls over the port not answered yet
        self.refused = 0  # calls refused as busy

    async def start(self, host: str, ports: Sequence[int] = (0,)) -> str:
        """Listens on `host`, on the first free port of `ports` (the config's `stage_ports`),
        and on a Unix socket for callers on this node where one can be made."""
        tls = tls_contexts()
        self._server = LinkServer(self._call, self._token, tls[0] if tls else None)
        try:
            port = await self._server.start(host, ports)
        except OSError as exc:
            raise RuntimeError(f"cannot bind a stage port on {host}: {exc}") from exc
        self.address = f"{host}:{port}"
        try:
            path = new_socket_path()
            await self._server.start_unix(path)
            self.unix = path
        except OSError as exc:
            logger.warning(
                "no Unix socket for the stage port %s (%s): callers on this node use TCP",
                self.address,
                exc,
            )
        self._load = LoadSlot(self.address)
        return self.address

    async def _call(self, request: bytes, images: int) -> bytes:
        """The batch's result, or the exception the stage raised (re-raised by the caller)."""
        bound = self._max_calls()
        if bound and self.in_flight + self._handle_calls() >= bound:
            self.refused += 1
            busy = f"this {self._deployment} replica holds {bound} calls (max_ongoing_requests)"
            return codec.dumps((False, StageBusy(busy)))
        self.in_flight += 1
        try:
            return await self._answer(request, images)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: bytes, images: int) -> bytes:
        self._load.add(images)
        try:
            try:
                running = self._run(self._batch_of(request))
                # no reference to the batch kept here: its crops on the GPU (another
                # process' memory) are let go of as soon as the stages are done with them
                result = await running
            finally:
                self._load.add(-images)
            reply = (True, result if self._then is None else await self._then(result))
        except Exception as exc:
            if code_for(exc) == Code.INTERNAL:  # a bug: its traceback stays here, in the log
                logger.exception("a stage call failed")
            # sent without its traceback, which holds the stages' frames (so the batch) and
            # this one, until the garbage collector runs
            reply = (False, exc.with_traceback(None))
        self.calls += 1
        try:
            return codec.dumps(reply)
        except Exception as exc:  # a bug: a result the codec does not carry
            logger.exception("a stage call's answer cannot be sent")
            return codec.dumps((False, exc.with_traceback(None)))

    def _batch_of(self, request: bytes) -> Batch:
        batch = codec.loads(request)
        if isinstance(batch, tuple) and len(batch) == 2:  # its images in shared memory
            batch = self._images.restore(*batch)
        if not isinstance(batch, Batch):
            raise codec.CodecError(f"a stage call of a {type(batch).__name__}, not a Batch")
        return batch

    async def stop(self, grace_s: float) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.unix:
            with contextlib.suppress(OSError):
                os.unlink(self.unix)
        self._images.close()
        if self._load is not None:
            self._load.close()


class PortCalls:
    """Calls to one stage deployment over its replicas' ports, by handle where none is known.

    `fallback(batch)`: the same call through Serve's handle; `token`: the stage token;
    `node`: this process's node address, and `shared_bytes` of shared memory to hand images
    to the replicas there (serve_app/transport/shared_images.py; 0: calls carry them);
    `node_id`: this process's Ray node id: replicas reporting it are called over their Unix
    sockets."""

    def __init__(
        self,
        registry: ModelRegistry,
        deployment: str,
        fallback: Callable[[Batch], Awaitable[Any]],
        token: str,
        node: str = "",
        shared_bytes: int = 0,
        metrics: StageCallMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        node_id: str = "",
    ) -> None:
        self._registry, self._deployment, self._fallback = registry, deployment, fallback
        self._node_id = node_id
        self._sockets: Mapping[str, str] = {}  # address -> Unix socket, replicas on this node
        self._metrics, self._clock = metrics, clock
        # address -> (when it may be called again, the delay that set it)
        self._backoff: dict[str, tuple[float, float]] = {}
        self._token = deployment_key(token, deployment)
        self._node = node
        self._images = ImageWriter(shared_bytes) if shared_bytes and node else None
        self._unshared: set[str] = set()  # addresses that could not map this node's memory
        self._crops_as_bytes: set[str] = set()  # addresses that could not open our GPU's
        self._links: dict[str, Link] = {}
        tls = tls_contexts()
        self._tls = tls[1] if tls else None
        self._in_flight: dict[str, int] = {}  # address -> this caller's images in its calls
        self._board = LoadBoard()  # the images each replica on this node holds
        self._holds: Mapping[str, Collection[str]] = {}  # address -> model versions held
        self._refresh_task: asyncio.Task | None = None
        self._following = True  # reading the addresses (until the replica stops)
        self._closing: set[asyncio.Task] = set()  # links closing or probed, until done
        self.by_handle = 0  # calls that went by handle (tests, logs)

    @property
    def transport(self) -> str:
        shared = ", images through shared memory on this node" if self._images is not None else ""
        return f"over the {self._deployment} replicas' own ports (stage_ports){shared}"

    async def run(self, batch: Batch) -> Any:
        if self._refresh_task is None and self._following:
            self._refresh_task = asyncio.create_task(self._refresh())
        tried: set[str] = set()
        while (address := self._pick(batch.model, tried)) is not None:
            tried.add(address)
            images = batch.image_count()
            self._in_flight[address] += images
            link = self._links[address]
            try:
                ok, value = await self._call(link, batch, images)
            except (LinkDown, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and cancelled_itself():
                    raise  # this call itself was cancelled, not its link's
                # The replica stopped or is cut off, failed the handshake, or the link closed
                # under a live call: the call goes to another replica's port, else by handle.
                self._count("port", "link_down")
                if self._links.get(address) is link:
                    self._back_off(address, str(exc) or "cancelled")
                continue
            finally:
                if self._links.get(address) is link:  # not a link opened since
                    self._in_flight[address] -= images
            self._backoff.pop(address, None)
            if not ok and isinstance(value, StageBusy):  # alive, full: another, or the handle
                self._count("port", "busy")
                continue
            self._count("port", "ok" if ok else "error")
            if not ok:
                try:
                    raise value
                finally:  # else the error's traceback and this frame hold each other, and
                    del value, batch  # the batch, until the garbage collector runs
            return value
        self.by_handle += 1
        try:
            value = await self._fallback(device_crops.on_host(batch))
        except Exception:
            self._count("handle", "error")
            raise
        self._count("handle", "ok")
        return value

    def _count(self, transport: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.count(self._deployment, transport, outcome)

    def _back_off(self, address: str, reason: str) -> None:
        """`address` failed: dropped, and not called again until a delay that doubles with
        each failure in a row (FIRST_BACKOFF_S to MAX_BACKOFF_S) has passed, whatever the
        registry reports meanwhile (a replica alive but cut off still reports)."""
        _, last = self._backoff.get(address, (0.0, FIRST_BACKOFF_S / 2))
        delay = min(2 * last, MAX_BACKOFF_S)
        self._backoff[address] = (self._clock() + delay, delay)
        logger.warning(
            "the stage port %s failed (%s); its calls go elsewhere for %.0f s",
            address,
            reason,
            delay,
        )
        self._drop(address)

    async def _call(self, link: Link, batch: Batch, images: int) -> tuple[bool, Any]:
        """One call over `link`, of `images` images; crops on the GPU by CUDA IPC where the
        replica can open them (serve_app/transport/device_crops.py), else their bytes."""
        address = link.address
        if address in self._crops_as_bytes or not self._on_this_node(address):
            return await self._call_with_images(link, device_crops.on_host(batch), images)
        ok, value = await self._call_with_images(link, batch, images)
        if ok or not isinstance(value, device_crops.CropsNotHere):
            return ok, value
        logger.warning(
            "the stage replica at %s cannot open this GPU's crops (%s); calls to "
            "it carry their bytes",
            address,
            value,
        )
        self._crops_as_bytes.add(address)
        return await self._call_with_images(link, device_crops.on_host(batch), images)

    async def _call_with_images(self, link: Link, batch: Batch, images: int) -> tuple[bool, Any]:
        """The images through shared memory where the replica is on this node, in the call
        otherwise (and again in the call if it cannot map them)."""
        shared = None
        address = link.address
        if (
            self._images is not None
            and self._on_this_node(address)
            and address not in self._unshared
        ):
            shared = self._images.put(batch)
        if shared is not None:
            name = shared[1].name
            try:
                ok, value = await _send(link, shared, images)
            except BaseException:  # the callee may still read it: not lent again
                self._images.release(name, reuse=False)
                raise
            missing = not ok and isinstance(value, SharedImagesMissing)
            self._images.release(name, reuse=not missing)
            if not missing:
                return ok, value
            logger.warning(
                "the stage replica at %s cannot map this node's shared memory (%s); calls "
                "to it carry their images",
                address,
                value,
            )
            self._unshared.add(address)
        return await _send(link, batch, images)

    def _on_this_node(self, address: str) -> bool:
        return address.rsplit(":", 1)[0] == self._node

    def _pick(self, model: str = "", tried: Collection[str] = ()) -> str | None:
        """The least busy address (ties at random), among those that report holding `model`
        where any does. Where every candidate is on this node and publishes its load
        (serve_app/transport/load_board.py): by the images it holds for all its callers, or this
        caller's own in flight to it if more (sent, not arrived yet). Otherwise by this
        caller's own images alone: the load of another node's replicas is not seen here,
        and beside the others' it would read as idle."""
        candidates = [address for address in self._in_flight if address not in tried]
        if not candidates:
            return None
        if model:
            holding = [a for a in candidates if model in self._holds.get(a, ())]
            candidates = holding or candidates
        loads = [self._in_flight[address] for address in candidates]
        if all(self._on_this_node(address) for address in candidates):
            published = [self._board.images(address) for address in candidates]
            if None not in published:
                loads = [max(own, seen) for own, seen in zip(loads, published, strict=True)]
        least = min(loads)
        return random.choice([a for a, n in zip(candidates, loads, strict=True) if n == least])

    def update(
        self, ports: Mapping[str, Collection[str]], sockets: Mapping[str, str] | None = None
    ) -> None:
        """The stage ports reported (address -> the model versions it holds), and the Unix
        sockets of those on this node (address -> path): open links to new addresses (or
        to a new socket), close those no longer reported. The load files are mapped anew
        (a replica started since on an address of one that stopped has a file of its own)."""
        sockets = sockets or {}
        for address in [a for a in self._links if sockets.get(a, "") != self._sockets.get(a, "")]:
            self._drop(address)  # another replica on that address: opened anew below
        self._holds, self._sockets = ports, sockets
        self._board.close()
        now = self._clock()
        for address in [a for a, (until, _) in self._backoff.items() if a not in ports]:
            del self._backoff[address]  # no longer reported: nothing to come back to
        addresses = {a for a in ports if self._backoff.get(a, (0.0, 0.0))[0] <= now}
        for address in addresses - self._links.keys():
            link = self._links[address] = Link(
                address, self._token, self._tls, self._sockets.get(address, "")
            )
            if address in self._backoff:  # it failed: no call waits on it before it answers
                task = asyncio.ensure_future(self._probe(address, link))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            else:
                self._in_flight[address] = 0
        for address in self._links.keys() - addresses:
            self._drop(address)

    async def _probe(self, address: str, link: Link) -> None:
        """`address`, back from its backoff, takes calls once it connects and proves the
        token; if it fails, its backoff doubles (a replica still cut off costs no call)."""
        try:
            await link.connect()
        except LinkDown as exc:
            if self._links.get(address) is link:
                self._back_off(address, str(exc))
            return
        if self._links.get(address) is link:
            self._in_flight[address] = 0

    def _drop(self, address: str) -> None:
        self._in_flight.pop(address, None)
        self._board.forget(address)
        link = self._links.pop(address, None)
        if link is not None:  # calls still in flight on it get CLOSE_GRACE_S to finish
            task = asyncio.ensure_future(link.close(CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _refresh(self) -> None:
        while True:
            try:
                self.update(*await asyncio.to_thread(self._read_ports))
            except Exception:  # a GCS hiccup must not stop following for good
                logger.exception("reading the %s replicas' addresses failed", self._deployment)
            await asyncio.sleep(ADDRESS_POLL_S)

    def _read_ports(self) -> tuple[dict[str, frozenset[str]], dict[str, str]]:
        return (
            self._registry.ports(self._deployment),
            self._registry.sockets(self._deployment, self._node_id),
        )

    def stop(self) -> None:
        """Stop reading the addresses, as the replica stops: no read runs into the process's
        shutdown (its thread pool gone). Calls go on over the links already open."""
        self._following = False
        if self._refresh_task is not None:
            self._refresh_task.cancel()

    async def close(self) -> None:
        self.stop()
        for address in list(self._links):
            self._drop(address)
        if self._images is not None:
            self._images.close()


async def _send(link: Link, message: Batch | tuple, images: int) -> tuple[bool, Any]:
    ok, value = codec.loads(await link.call(codec.dumps(message), images))
    return ok, list(value) if ok and isinstance(value, tuple) else value
