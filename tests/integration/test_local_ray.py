"""`raystream serve` as `make serve` runs it: the local Ray it starts (through `serve run`)
listens on loopback only and refuses drivers without its token, Ray's metrics leave the
machine only when asked (--expose-metrics), and the console carries what an operator needs:
no access-log line per Ray call, no warning on every start, no error on every stop."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, free_port

pytestmark = pytest.mark.slow
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s local address (host byte order, 32-bit words) -> the address."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listening() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode -> (address, port)."""
    sockets = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == LISTEN:
                host, port = local.split(":")
                sockets[inode] = (str(_address(host)), int(port, 16))
    return sockets


def _descendants(pid: int) -> set[int]:
    """`pid` and every process below it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo += children.get(current, [])
    return found


def listening_sockets(pid: int) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every socket that `pid` or a process below it
    listens on."""
    sockets = _listening()
    found = []
    for process in _descendants(pid):
        try:
            name = Path(f"/proc/{process}/comm").read_text().strip()
            fds = list(Path(f"/proc/{process}/fd").iterdir())
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in sockets:
                    found.append((process, name, *sockets[inode]))
    return sorted(set(found))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket's IPv4
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class Server:
    """`raystream serve` in a process group of its own; its output collected as it comes."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "clients.cli", "serve", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a failed test kills the Serve child and Ray too
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = next((line for line in self.lines if text in line), None)
            if line is not None:
                return line
            assert self.process.poll() is None, f"raystream serve exited:\n{self.output[-4000:]}"
            time.sleep(0.5)  # polling the server's output
        raise AssertionError(f"no {text!r} after {timeout} s:\n{self.output[-4000:]}")

    def stop(self) -> int:
        """Ctrl-C in a terminal: SIGINT to the whole process group, `serve run` included."""
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=120)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(model_repository):
    """The default config (topology chained, four deployments), Ray's metrics exposed to a
    scraper on loopback (the test's machine may be on a network)."""
    port, metrics_port = free_port(), free_port()
    server = Server(
        *("--port", str(port), "--model-repository", str(model_repository)),
        *("--expose-metrics", f"127.0.0.1:{metrics_port}"),
    )
    server.port, server.metrics_port = port, metrics_port
    try:
        server.ready = server.wait_for("raystream ready", timeout=400)
        yield server
    finally:
        if server.process.poll() is None:
            server.stop()


def test_the_local_ray_listens_on_loopback_only(server) -> None:
    sockets = listening_sockets(server.process.pid)
    names = {name for _, name, _, _ in sockets}
    # not vacuous: Ray's own servers and the ingress are among them
    assert {"gcs_server", "raylet"} <= names, sockets
    assert any(port == server.port for *_, port in sockets), sockets
    assert len(sockets) >= 10, sockets
    exposed = [s for s in sockets if not is_loopback(s[2])]
    assert not exposed, f"listening beyond loopback (pid, name, address, port): {exposed}"
    # the cluster the ready line names is on loopback too (reconfigure's --address)
    assert "Ray cluster 127.0.0.1:" in server.ready, server.ready


def test_it_classifies_and_logs_no_line_per_ray_call(server, photos, tmp_path) -> None:
    photo = tmp_path / "chelsea.jpg"
    photo.write_bytes(photos["chelsea"])
    address = f"127.0.0.1:{server.port}"
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-m", "clients.cli", "classify", str(photo), "--server", address],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0 and "cat" in result.stdout, result.stderr
    time.sleep(2)  # Ray forwards the replicas' log lines to the console within a second
    calls = [line for line in server.lines if " -- CALL " in line]
    assert not calls, f"Serve's access log is on: {calls[:3]}"


def test_ray_metrics_reach_a_scraper_only_through_expose_metrics(server) -> None:
    """--expose-metrics copies the metrics agent's Prometheus text (raystream's metrics
    among it) to its own address; the agent itself stays on loopback (checked above)."""
    assert f"Ray metrics on http://127.0.0.1:{server.metrics_port}/metrics" in server.ready
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    deadline, text = time.monotonic() + 120, ""
    while "raystream_inference_request_total" not in text and time.monotonic() < deadline:
        time.sleep(2)  # the replicas report every few seconds
        with urllib.request.urlopen(url, timeout=30) as reply:
            assert reply.status == 200
            text = reply.read().decode()
    assert "ray_raystream_inference_request_total" in text, text[:2000]


def test_a_ray_driver_without_the_token_is_refused(server, tmp_path) -> None:
    """The local Ray that `raystream serve` starts has Ray's token authentication on: a
    driver without the token cannot join it (nor run code on it); with it, it can."""
    address = server.ready.split("Ray cluster ")[1].split(";")[0]
    code = f"import ray; ray.init(address={address!r}); print('joined', len(ray.nodes()))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}

    def driver(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=180,
        )

    refused = driver(HOME=str(tmp_path))  # no ~/.ray/auth_token there
    assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused.stderr[-2000:]
    allowed = driver(RAY_AUTH_MODE="token")  # the token `serve run` keeps in ~/.ray/auth_token
    assert allowed.returncode == 0 and "joined 1" in allowed.stdout, allowed.stderr[-2000:]


def test_start_and_stop_print_no_warning_or_error(server) -> None:
    """Ray 2.60 warned "Cannot deregister autoscaling state" for every deployment without
    autoscaling on every start, and the raylet reported the controller's graceful_shutdown
    as a failed task on every stop."""
    assert server.stop() == 0
    output = server.output
    assert "Cannot deregister autoscaling state" not in output, output[-3000:]
    assert "graceful_shutdown failed" not in output, output[-3000:]
    traceback = output.find("Traceback")
    assert traceback < 0, output[traceback : traceback + 20000]  # the first one, whole
    assert "Got KeyboardInterrupt, shutting down" in output  # it did stop, as Ctrl-C does
    # one SIGINT for `serve run`: a second (passed on by raystream) cut its shutdown short
    assert "Aborted!" not in output, output[-3000:]
