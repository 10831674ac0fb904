"""Stage calls to a replica on the caller's node go over the replica's Unix socket
(serve_app/transport/unix_sockets.py), calls to another node's over TCP: real link servers on
loopback and real sockets, the registry in memory. A socket that cannot be reached costs
the call nothing: it goes over TCP, or to another replica."""

from __future__ import annotations

import os
import socket
import stat

import pytest
from test_stage_port import TOKEN, Fallback, Stage, _batch

from serve_app.models.registry import MemoryStore, ModelRegistry
from serve_app.transport import call_link, unix_sockets
from serve_app.transport.stage_port import PortCalls, StagePort

NODE, OTHER_NODE = "a" * 56, "b" * 56  # Ray node ids


@pytest.fixture(autouse=True)
def any_send_buffer(monkeypatch) -> None:
    """The socket is used whatever send buffer this host grants (net.core.wmem_max)."""
    monkeypatch.setattr(call_link, "UNIX_MIN_SEND_BUFFER_BYTES", 0)


async def _port(registry: ModelRegistry, name: str, unix: str | None = None) -> StagePort:
    """A replica `name` on NODE; `unix`: the socket it reports, if not its own."""
    port = StagePort(Stage(name).run, TOKEN, "Inference")
    address = await port.start("127.0.0.1")
    registry.report(
        "Inference", name, [], address=address, node=NODE, unix=port.unix if unix is None else unix
    )
    return port


def _family(calls: PortCalls, address: str) -> socket.AddressFamily:
    return calls._links[address]._writer.get_extra_info("socket").family


async def test_a_caller_on_the_node_calls_the_socket_of_mode_0600_and_others_call_tcp() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    port = await _port(registry, "r1")
    assert stat.S_IMODE(os.stat(port.unix).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(port.unix)).st_mode) == 0o700
    here = PortCalls(registry, "Inference", Fallback(), TOKEN, node_id=NODE)
    there = PortCalls(registry, "Inference", Fallback(), TOKEN, node_id=OTHER_NODE)
    for calls in (here, there):
        calls.update(*calls._read_ports())  # what the caller reads every second
        assert await calls.run(_batch()) == ["r1", "a"]
    assert _family(here, port.address) == socket.AF_UNIX
    assert _family(there, port.address) == socket.AF_INET
    assert port.calls == 2 and here.by_handle == there.by_handle == 0
    for calls in (here, there):
        await calls.close()
    await port.stop(0)
    assert not os.path.exists(port.unix)  # removed as the replica stops


@pytest.mark.parametrize("socket_is", ["stale", "missing"])
async def test_a_socket_that_cannot_be_reached_sends_the_call_over_tcp(tmp_path, socket_is) -> None:
    """A socket file left by a process killed (nobody listens) or gone (another container's
    /tmp): the call goes over TCP to the same replica, as the link's later calls do."""
    path = str(tmp_path / "stage.sock")
    if socket_is == "stale":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.close()  # the file stays, refusing connections
    registry = ModelRegistry(MemoryStore(), "app")
    port = await _port(registry, "r1", unix=path)
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN, node_id=NODE)
    calls.update(*calls._read_ports())
    assert await calls.run(_batch()) == ["r1", "a"]
    assert await calls.run(_batch()) == ["r1", "a"]
    assert _family(calls, port.address) == socket.AF_INET
    assert calls._links[port.address].unix == ""  # tried once, not at every connect
    assert port.calls == 2 and fallback.batches == []
    await calls.close()
    await port.stop(0)


async def test_where_the_kernel_grants_too_small_a_send_buffer_calls_go_over_tcp(
    monkeypatch,
) -> None:
    """A socket that sends a large call in small parts costs more than TCP: not used."""
    monkeypatch.setattr(call_link, "UNIX_MIN_SEND_BUFFER_BYTES", 1 << 40)
    registry = ModelRegistry(MemoryStore(), "app")
    port = await _port(registry, "r1")
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN, node_id=NODE)
    calls.update(*calls._read_ports())
    assert await calls.run(_batch()) == ["r1", "a"]
    assert _family(calls, port.address) == socket.AF_INET and port.calls == 1
    await calls.close()
    await port.stop(0)


async def test_a_replica_stopped_with_its_socket_gone_loses_no_call_to_the_other() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    stopped, alive = await _port(registry, "r1"), await _port(registry, "r2")
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN, node_id=NODE)
    calls.update(*calls._read_ports())
    await stopped.stop(0)  # its report is still fresh; its socket and port are gone
    for _ in range(4):
        assert await calls.run(_batch()) == ["r2", "a"]
    assert alive.calls == 4 and fallback.batches == []
    await calls.close()
    await alive.stop(0)


async def test_a_new_replica_on_an_address_is_called_on_its_own_socket() -> None:
    """The registry reports another socket for a known address (a replica started on the
    port of one that stopped): the link is opened anew, to the new socket."""
    registry = ModelRegistry(MemoryStore(), "app")
    port = await _port(registry, "r1", unix="/nonexistent/old.sock")
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN, node_id=NODE)
    calls.update(*calls._read_ports())
    assert await calls.run(_batch()) == ["r1", "a"]
    assert _family(calls, port.address) == socket.AF_INET
    registry.report("Inference", "r1", [], address=port.address, node=NODE, unix=port.unix)
    calls.update(*calls._read_ports())
    assert await calls.run(_batch()) == ["r1", "a"]
    assert _family(calls, port.address) == socket.AF_UNIX
    await calls.close()
    await port.stop(0)


async def test_a_socket_directory_open_to_others_is_refused_and_the_port_serves_tcp(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(unix_sockets.tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / f"raystream-{os.getuid()}"
    planted.mkdir(mode=0o755)
    os.chmod(planted, 0o755)  # whatever the umask
    with pytest.raises(PermissionError, match="alone"):
        unix_sockets.socket_directory()
    port = StagePort(Stage("r1").run, TOKEN, "Inference")
    await port.start("127.0.0.1")
    assert port.unix == "" and os.listdir(planted) == []
    await port.stop(0)


def test_the_sockets_of_dead_processes_are_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(unix_sockets.tempfile, "gettempdir", lambda: str(tmp_path))
    directory = unix_sockets.socket_directory()
    dead = directory / "stage-999999999-00ff.sock"  # no such pid
    mine = directory / f"stage-{os.getpid()}-00ff.sock"
    dead.touch()
    mine.touch()
    unix_sockets.new_socket_path()
    assert not dead.exists() and mine.exists()
