"""The framed link under the stage ports (serve_app/transport/call_link.py): a real server and real
connections on loopback."""

from __future__ import annotations

import asyncio

import pytest
from certificates import issue_certificate, write_pem
from support import until

from serve_app.transport import call_link
from serve_app.transport.call_link import Link, LinkDown, LinkServer

TOKEN = b"app secret"


async def _server(handler) -> tuple[LinkServer, str]:
    server = LinkServer(handler, TOKEN)
    return server, f"127.0.0.1:{await server.start('127.0.0.1')}"


async def test_many_calls_on_one_link_are_answered_each_by_its_own_answer() -> None:
    """Calls run at once on the replica and answer in any order; each caller gets its own."""
    seen = []

    async def handler(request: bytes, images: int) -> bytes:
        seen.append(images)
        await asyncio.sleep(0.05 * (len(request) % 3))  # simulated work: answers out of order
        return request * 2

    server, address = await _server(handler)
    link = Link(address, TOKEN)
    answers = await asyncio.gather(*(link.call(str(n).encode(), n) for n in range(30)))
    assert answers == [str(n).encode() * 2 for n in range(30)]
    assert sorted(seen[:30]) == list(range(30))
    big = bytes(range(256)) * 40_000  # 10 MB each way
    assert await link.call(big) == big * 2
    await link.close()
    await server.stop(0)


async def test_a_replica_that_stops_fails_the_calls_waiting_and_a_closed_link_refuses() -> None:
    arrived = asyncio.Event()

    async def handler(request: bytes, images: int) -> bytes:
        arrived.set()
        await asyncio.sleep(10)  # simulated work, past the stop's grace
        return request

    server, address = await _server(handler)
    link = Link(address, TOKEN)
    waiting = asyncio.ensure_future(link.call(b"x"))
    await asyncio.wait_for(arrived.wait(), 5)
    await server.stop(0.05)  # its grace runs out
    with pytest.raises(LinkDown):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(LinkDown, match="cannot reach"):
        await link.call(b"y")
    await link.close()
    with pytest.raises(LinkDown, match="closed"):
        await link.call(b"z")


async def test_a_stopping_replica_lets_calls_in_flight_finish_within_its_grace() -> None:
    arrived = asyncio.Event()

    async def handler(request: bytes, images: int) -> bytes:
        arrived.set()
        await asyncio.sleep(0.2)  # simulated work, within the stop's grace
        return request

    server, address = await _server(handler)
    link = Link(address, TOKEN)
    waiting = asyncio.ensure_future(link.call(b"x"))
    await asyncio.wait_for(arrived.wait(), 5)
    await server.stop(5)
    assert await waiting == b"x"
    await link.close()


async def test_a_wrong_token_is_refused_and_a_caller_cancelled_leaves_the_link_working() -> None:
    gate, late = asyncio.Event(), asyncio.Event()

    async def handler(request: bytes, images: int) -> bytes:
        if request == b"wait":
            await gate.wait()
            late.set()  # its answer is written as this returns: before any later call's
        return request

    server, address = await _server(handler)
    with pytest.raises(LinkDown, match="refused"):
        await Link(address, b"guess").call(b"x")
    link = Link(address, TOKEN)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(link.call(b"wait"), 0.1)
    assert await link.call(b"next") == b"next"
    gate.set()
    await asyncio.wait_for(late.wait(), 5)  # the cancelled call's late answer, to be dropped
    assert await link.call(b"again") == b"again"
    await link.close()
    await server.stop(0)


async def test_a_handler_that_raises_breaks_its_link_rather_than_leave_a_call_unanswered(
    caplog,
) -> None:
    async def handler(request: bytes, images: int) -> bytes:
        if request == b"bug":
            raise RuntimeError("a bug")
        await asyncio.sleep(0.1)  # simulated work: in flight when its neighbour raises
        return request

    server, address = await _server(handler)
    link = Link(address, TOKEN)
    other = asyncio.ensure_future(link.call(b"other"))
    with pytest.raises(LinkDown):
        await asyncio.wait_for(link.call(b"bug"), 5)
    with pytest.raises(LinkDown):  # its neighbour on the link fails too: nothing hangs
        await asyncio.wait_for(other, 5)
    assert "a stage call raised" in caplog.text
    assert await link.call(b"after") == b"after"  # a new connection
    await link.close()
    await server.stop(0)


async def test_a_stopping_replica_serves_the_calls_sent_during_its_grace() -> None:
    """Callers learn of a stop a poll later: what they send meanwhile is served, not cut."""

    arrived = asyncio.Event()

    async def handler(request: bytes, images: int) -> bytes:
        arrived.set()
        await asyncio.sleep(0.3)  # simulated work: the stop waits for it
        return request

    server, address = await _server(handler)
    link = Link(address, TOKEN)
    first = asyncio.ensure_future(link.call(b"first"))
    await asyncio.wait_for(arrived.wait(), 5)
    stopping = asyncio.ensure_future(server.stop(5))
    await asyncio.sleep(0)  # the stop's first step runs: no new connections, grace begun
    assert await link.call(b"during") == b"during"
    assert await first == b"first"
    await stopping
    await link.close()


async def test_a_connection_reset_under_load_answers_every_call_or_fails_it_as_link_down() -> None:
    """The replica's end reset while calls are written and answered: each call gets its
    answer or LinkDown (its caller then goes by handle), none hangs or raises otherwise,
    and the next connection serves."""
    server: LinkServer

    async def handler(request: bytes, images: int) -> bytes:
        if request == b"reset":
            for writer in list(server._connections):
                writer.transport.abort()
        await asyncio.sleep(0.01)  # simulated work: calls overlap the reset
        return request

    server, address = await _server(handler)
    for _ in range(3):
        link = Link(address, TOKEN)
        calls = [link.call(b"reset"), *(link.call(b"x") for _ in range(60))]
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        assert all(o in (b"x", b"reset") or isinstance(o, LinkDown) for o in outcomes), outcomes
        assert any(isinstance(o, LinkDown) for o in outcomes)
        await link.close()
    link = Link(address, TOKEN)
    assert await asyncio.wait_for(link.call(b"after"), 5) == b"after"
    await link.close()
    await server.stop(0)


async def test_a_port_that_never_answers_the_token_fails_the_call_in_time(monkeypatch) -> None:
    """A port that takes the connection and says nothing (a wedged or foreign process): the
    call fails as LinkDown after HELLO_TIMEOUT_S, not never."""
    import serve_app.transport.call_link as call_link

    monkeypatch.setattr(call_link, "HELLO_TIMEOUT_S", 0.2)
    held = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await asyncio.sleep(5)  # holds the connection, silent

    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    address = f"127.0.0.1:{mute.sockets[0].getsockname()[1]}"
    with pytest.raises(LinkDown, match="cannot reach"):
        await asyncio.wait_for(Link(address, TOKEN).call(b"x"), 5)
    for writer in held:
        writer.close()
    mute.close()


async def test_a_peer_that_stops_reading_fails_the_call_after_the_user_timeout(
    monkeypatch,
) -> None:
    """A replica that accepted the token and then reads nothing more (hung, or its host gone
    with the data unacknowledged): once a call's bytes have waited USER_TIMEOUT_S in the
    kernel, the connection drops and the call fails as LinkDown, instead of waiting for the
    registry to drop the address."""
    import serve_app.transport.call_link as call_link

    monkeypatch.setattr(call_link, "USER_TIMEOUT_S", 1)
    held = []

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        hello = await reader.readexactly(len(call_link.HELLO) + call_link.NONCE_BYTES)
        theirs, ours = hello[len(call_link.HELLO) :], bytes(call_link.NONCE_BYTES)
        writer.write(ours + call_link._mac(TOKEN, b"replica", theirs, ours))
        await reader.readexactly(call_link.MAC_BYTES)
        writer.write(call_link.ACCEPTED)
        await asyncio.sleep(30)  # reads nothing more: its receive window fills

    peer = await asyncio.start_server(hung, "127.0.0.1", 0)
    address = f"127.0.0.1:{peer.sockets[0].getsockname()[1]}"
    started = asyncio.get_running_loop().time()
    with pytest.raises(LinkDown):
        await asyncio.wait_for(Link(address, TOKEN).call(b"x" * (64 << 20)), 20)
    assert asyncio.get_running_loop().time() - started < 10
    for writer in held:
        writer.close()
    peer.close()


async def test_a_listener_at_a_stale_address_learns_nothing_it_can_use() -> None:
    """Whoever binds the address of a replica that is gone gets the caller's nonce alone:
    the caller waits for a proof of the token before it sends anything else, and a stranger
    cannot make one (here it answers a MAC under another token, then call bytes)."""
    received = bytearray()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.readexactly(len(call_link.HELLO) + call_link.NONCE_BYTES))
        ours = bytes(call_link.NONCE_BYTES)
        writer.write(ours + call_link._mac(b"a guess", b"replica", received[4:], ours))
        writer.write(call_link.ACCEPTED + call_link.ANSWER.pack(0, 5) + b"bytes")
        received.extend(await reader.read())  # whatever the caller sends before it closes

    listener = await asyncio.start_server(impostor, "127.0.0.1", 0)
    link = Link(f"127.0.0.1:{listener.sockets[0].getsockname()[1]}", TOKEN)
    with pytest.raises(LinkDown, match="did not prove"):
        await link.call(b"a batch's bytes")
    assert len(received) == len(call_link.HELLO) + call_link.NONCE_BYTES
    assert TOKEN not in received and b"a batch" not in received
    listener.close()


async def test_a_replayed_proof_is_refused_before_any_call_is_read() -> None:
    """A caller's proof covers the replica's fresh nonce: replayed on a new connection (same
    caller nonce), it is refused, and the call behind it never reaches the handler."""
    seen = []

    async def handler(request: bytes, images: int) -> bytes:
        seen.append(request)
        return b"ok"

    server, address = await _server(handler)
    host, port = address.rsplit(":", 1)
    nonce = bytes(range(call_link.NONCE_BYTES))

    async def handshake(proof: bytes | None) -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(call_link.HELLO + nonce)
        reply = await reader.readexactly(call_link.NONCE_BYTES + call_link.MAC_BYTES)
        theirs = reply[: call_link.NONCE_BYTES]
        proof = proof or call_link._mac(TOKEN, b"caller", nonce, theirs)
        writer.write(proof + call_link.CALL.pack(0, 1, 4) + b"call")
        answer = await reader.read(1)
        writer.close()
        return proof if answer == call_link.ACCEPTED else b""

    recorded = await handshake(None)
    assert recorded  # the genuine proof was accepted
    assert await handshake(recorded) == b""  # replayed: closed, nothing accepted
    await until(lambda: len(seen) == 1)
    assert seen == [b"call"]  # the genuine connection's call only
    await server.stop(0)


async def test_with_rays_tls_on_a_tap_on_the_link_sees_no_bytes_in_clear(
    tmp_path, monkeypatch
) -> None:
    """With Ray's TLS settings, each end shows its certificate and checks the other's
    against Ray's CA: a tap between them sees neither the token's proof inputs nor the
    call and answer in clear, and a peer without a certificate of that CA gets nothing."""
    ca_key, ca = issue_certificate("ray ca", ca=True)
    node_key, node = issue_certificate("node", ca_key, ca.subject, ca=False)
    key_path, cert_path = write_pem(tmp_path / "node", node_key, node)
    _, ca_path = write_pem(tmp_path / "ca", ca_key, ca)
    monkeypatch.setenv("RAY_USE_TLS", "1")
    monkeypatch.setenv("RAY_TLS_SERVER_CERT", str(cert_path))
    monkeypatch.setenv("RAY_TLS_SERVER_KEY", str(key_path))
    monkeypatch.setenv("RAY_TLS_CA_CERT", str(ca_path))
    server_tls, client_tls = call_link.tls_contexts()

    async def handler(request: bytes, images: int) -> bytes:
        return request + b" labelled Egyptian cat"

    server = LinkServer(handler, TOKEN, server_tls)
    port = await server.start("127.0.0.1")
    seen = bytearray()

    async def tap(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)

        async def pipe(source, sink) -> None:
            while data := await source.read(65536):
                seen.extend(data)
                sink.write(data)
            sink.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    relay = await asyncio.start_server(tap, "127.0.0.1", 0)
    address = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
    link = Link(address, TOKEN, client_tls)
    photo = b"\xff\xd8 a photo's bytes " * 100
    assert await link.call(photo) == photo + b" labelled Egyptian cat"
    assert seen and b"a photo's bytes" not in seen and b"Egyptian cat" not in seen
    assert call_link.HELLO not in seen  # the handshake runs inside TLS too
    await link.close()
    with pytest.raises(LinkDown):  # no certificate of Ray's CA: no connection
        await Link(address, TOKEN).call(b"x")
    relay.close()
    await server.stop(0)


_SLOW_REPLICA = """
import asyncio, sys
from serve_app.transport.call_link import LinkServer

async def main():
    async def handler(request, images):
        print(request.decode(), flush=True)  # the call arrived
        await asyncio.sleep(float(request))  # a call that takes this many seconds
        return request
    server = LinkServer(handler, sys.argv[1].encode())
    print(await server.start("127.0.0.1"), flush=True)
    await asyncio.sleep(3600)  # serves until the test kills it

asyncio.run(main())
"""


async def test_a_replica_process_that_hangs_fails_its_calls_within_the_silence_limit() -> None:
    """A replica frozen with SIGSTOP while its host lives: its kernel still acknowledges the
    call and answers TCP keepalive, so only the replica's beats tell: a call that takes
    longer than SILENT_S is answered while they come, and one waiting on the frozen process
    fails as LinkDown within SILENT_S + BEAT_S / 2, not when the registry drops it."""
    import os
    import signal
    import sys

    from conftest import ROOT

    replica = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SLOW_REPLICA, TOKEN.decode(), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        port = int(await asyncio.wait_for(replica.stdout.readline(), 60))
        link = Link(f"127.0.0.1:{port}", TOKEN)
        slow = 2 * call_link.SILENT_S
        assert await asyncio.wait_for(link.call(str(slow).encode()), 30) == str(slow).encode()
        assert await replica.stdout.readline() == f"{slow}\n".encode()
        waiting = asyncio.ensure_future(link.call(b"30"))
        assert await asyncio.wait_for(replica.stdout.readline(), 10) == b"30\n"  # it arrived
        loop = asyncio.get_running_loop()
        os.kill(replica.pid, signal.SIGSTOP)
        stopped = loop.time()
        with pytest.raises(LinkDown, match="sent nothing"):
            await asyncio.wait_for(waiting, 10)
        waited = loop.time() - stopped
        assert waited <= call_link.SILENT_S + call_link.BEAT_S / 2 + 0.5, waited
        await link.close()
    finally:
        os.kill(replica.pid, signal.SIGCONT)
        replica.kill()
        await replica.wait()
