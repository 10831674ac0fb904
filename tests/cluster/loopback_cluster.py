"""A multi-node Ray cluster on one machine, for the cluster tests and the autoscaling benchmark:
a head and worker nodes started with `ray start`, as on a real cluster, each declaring its own
custom resources, Ray's token authentication on; raystream deployed onto it with `serve deploy`.

Every node is at 127.0.0.1, in a network namespace of its own. Ray binds its servers to
127.0.0.1 only when a node's address is 127.0.0.1, and `ray start` on a worker node replaces
127.0.0.1 (from --node-ip-address or the head's address) with the machine's own address
(ray._private.services.resolve_ip_for_localhost); the setting that stops that,
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, also refuses to start worker nodes. In a network namespace
that has only `lo`, the machine's address Ray looks for (the route to 8.8.8.8) does not exist,
so every node resolves to 127.0.0.1 and nothing is reachable from outside the namespace.
`run_isolated` starts a command in such a namespace (`unshare --net --map-root-user`).

Ownership: everything in this namespace belongs to the process that made it, so `stop` ends
every process in the namespace but the caller and its ancestors. `ray stop` is never used: it
ends every Ray process on the machine, whoever started it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
GCS_PORT = 26379  # ports inside the private namespace: nothing else listens there
DASHBOARD_PORT = 28265
CLIENT_PORT = 20001  # the Ray Client server (ray://)
# Settings of this process that must not reach the nodes: the tests' own local-Ray settings
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 refuses worker nodes; clients/local_ray.py's worker
# hook), any cluster address and token.
_NOT_PASSED = (
    "RAY_ADDRESS",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR",
)


def in_private_network() -> bool:
    """True in a network namespace whose only interface is the loopback one."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def isolated_command(argv: list[str]) -> list[str]:
    """`argv` run in a new network namespace that has only `lo`, brought up first."""
    script = 'ip link set lo up && exec "$@"'
    return ["unshare", "--net", "--map-root-user", "--", "sh", "-c", script, "sh", *argv]


def run_isolated(argv: list[str]) -> int:
    """Runs `argv` in a private loopback-only network namespace; its exit status."""
    return subprocess.call(isolated_command(argv))


@dataclass
class Node:
    name: str
    resources: dict[str, float]
    process: subprocess.Popen  # `ray start --block`: the node lives as long as it does
    log: Path
    index: int

    def raylet_pid(self) -> int | None:
        for pid in _children(self.process.pid):
            if comm(pid) == "raylet":
                return pid
        return None


@dataclass
class LoopbackCluster:
    """`start_head()`, then `add_node()` per worker; `stop()` ends every node (use `with`)."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp")))
    object_store_bytes: int = 150 * 1024 * 1024
    nodes: dict[str, Node] = field(default_factory=dict)
    keep_logs: Path | None = None  # where `stop` copies Ray's and the nodes' logs first
    tls: bool = False  # Ray's TLS on every process of the cluster, certificates made here

    def __post_init__(self) -> None:
        if not in_private_network():
            raise RuntimeError(
                "LoopbackCluster runs only in a private network namespace (only `lo`): run "
                "under `unshare --net --map-root-user` (make test-cluster does)"
            )
        self.token = secrets.token_hex(32)
        self.token_path = self.root / "ray-token"
        self.token_path.write_text(self.token)
        self.token_path.chmod(0o600)
        self._tls_env: dict[str, str] = {}
        if self.tls:  # one CA, one certificate for 127.0.0.1 that every node shows
            from certificates import issue_certificate, write_pem

            ca_key, ca = issue_certificate("ray ca", ca=True)
            key, cert = issue_certificate("ray node", ca_key, ca.subject, ca=False)
            key_path, cert_path = write_pem(self.root / "ray-node", key, cert)
            _, ca_path = write_pem(self.root / "ray-ca", ca_key, ca)
            self._tls_env = {
                "RAY_USE_TLS": "1",
                "RAY_TLS_SERVER_CERT": str(cert_path),
                "RAY_TLS_SERVER_KEY": str(key_path),
                "RAY_TLS_CA_CERT": str(ca_path),
            }

    # -- environment --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{HOST}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{HOST}:{DASHBOARD_PORT}"

    def env(self, token: bool = True) -> dict[str, str]:
        """Environment of a Ray process of this cluster: the nodes, `serve deploy`, drivers.
        `token=False`: a client that does not hold the token (the tests' unauthorised one)."""
        env = {k: v for k, v in os.environ.items() if k not in _NOT_PASSED}
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        # The Ray Client server forks a session's server from a gRPC thread; with gRPC's fork
        # handlers on, that child was seen to die of SIGSEGV before its exec in 3 of 6 starts
        # on 2 cores ("Starting Ray client server failed"); with them off, in none of 4.
        env["GRPC_ENABLE_FORK_SUPPORT"] = "0"
        env.update(self._tls_env)
        if token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        else:
            env.pop("RAY_AUTH_MODE", None)
            env["HOME"] = str(self.root / "no-token-home")  # no ~/.ray/auth_token either
        return env

    # -- nodes --------------------------------------------------------------------------------

    def start_head(self, num_cpus: int, resources: dict[str, float]) -> Node:
        return self._start(
            "head",
            num_cpus,
            resources,
            [
                "--head",
                f"--port={GCS_PORT}",
                f"--temp-dir={self.root / 'ray'}",
                f"--dashboard-host={HOST}",
                f"--dashboard-port={DASHBOARD_PORT}",
                f"--ray-client-server-port={CLIENT_PORT}",
            ],
        )

    def add_node(
        self, name: str, num_cpus: int, resources: dict[str, float], env: dict | None = None
    ) -> Node:
        """A worker node; `env`: settings of its own processes (over this cluster's)."""
        return self._start(name, num_cpus, resources, [f"--address={self.address}"], env)

    def _start(
        self, name: str, num_cpus: int, resources: dict, extra: list[str], env: dict | None = None
    ) -> Node:
        index = len(self.nodes)
        log = self.root / f"{name}.log"
        argv = [
            str(BIN / "ray"),
            "start",
            "--block",
            *extra,
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps(resources)}",
            f"--object-store-memory={self.object_store_bytes}",
            # Several nodes on one address: each node's fixed ports must differ.
            f"--dashboard-agent-listen-port={21000 + index}",
            f"--metrics-export-port={21100 + index}",
            "--disable-usage-stats",
        ]
        with log.open("w") as out:
            process = subprocess.Popen(
                argv,
                env={**self.env(), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
        node = Node(name, resources, process, log, index)
        self.nodes[name] = node
        self._wait_registered(node)
        return node

    def _wait_registered(self, node: Node, timeout: float = 120.0) -> None:
        """Until the GCS lists the node alive (by the custom resources only it declares)."""
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            if node.process.poll() is not None:
                raise RuntimeError(f"node {node.name} exited: {node.log.read_text()[-3000:]}")
            try:
                if any(
                    all(n["resources_total"].get(k) == v for k, v in node.resources.items())
                    for n in self.alive_nodes()
                ):
                    return
            except OSError:  # the dashboard is not up yet
                pass
            time.sleep(1.0)  # polling
        raise TimeoutError(f"node {node.name} did not join within {timeout:.0f} s")

    def alive_nodes(self) -> list[dict]:
        """The state API's nodes that are alive: node_id, node_ip, resources_total, ..."""
        reply = self.get("/api/v0/nodes?detail=1&limit=100")
        return [n for n in reply["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def kill_raylet(self, name: str) -> int:
        """SIGKILL the raylet of node `name` (its `ray start --block` then ends the rest of
        the node's processes, as a machine that is gone would); the raylet's pid."""
        pid = self.nodes[name].raylet_pid()
        if pid is None:
            raise RuntimeError(f"node {name} has no raylet")
        os.kill(pid, signal.SIGKILL)
        return pid

    # -- Serve and the dashboard --------------------------------------------------------------

    def get(self, path: str, token: bool = True) -> dict:
        """GET a dashboard path (JSON), with the cluster's token unless `token=False`."""
        headers = {"Authorization": f"Bearer {self.token}"} if token else {}
        request = urllib.request.Request(self.dashboard + path, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    def serve_deploy(self, config: Path) -> None:
        """`serve deploy` as a cluster user runs it, through the dashboard."""
        subprocess.run(
            [str(BIN / "serve"), "deploy", str(config), "--address", self.dashboard],
            env=self.env(),
            check=True,
            timeout=120,
            capture_output=True,
        )

    def applications(self) -> dict:
        """Serve's view of its applications (what `serve status` shows), with every
        replica's state, node and pid."""
        return self.get("/api/serve/applications/")["applications"]

    def wait_running(self, app: str, timeout: float = 600.0) -> dict:
        """Until application `app` is RUNNING; its details."""
        give_up, status = time.monotonic() + timeout, None
        while time.monotonic() < give_up:
            details = self.applications().get(app)
            status = details and details["status"]
            if status == "RUNNING":
                return details
            if status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"{app} is {status}: {details.get('message')}")
            time.sleep(1.0)  # polling
        raise TimeoutError(f"{app} not RUNNING within {timeout:.0f} s (last: {status})")

    def replicas(self, app: str, deployment: str, state: str = "RUNNING") -> list[dict]:
        details = self.applications()[app]["deployments"][deployment]
        return [r for r in details["replicas"] if r["state"] == state]

    def node_of(self, node_id: str) -> str:
        """The name of the node (as added here) whose id is `node_id`."""
        for n in self.alive_nodes():
            if n["node_id"] == node_id:
                for name, node in self.nodes.items():
                    if all(n["resources_total"].get(k) == v for k, v in node.resources.items()):
                        return name
        raise KeyError(f"no alive node {node_id}")

    # -- the end ------------------------------------------------------------------------------

    def stop(self) -> None:
        """End every node, then whatever is left in this namespace (workers whose raylet died
        keep running for a while), and remove the cluster's files."""
        for node in reversed(list(self.nodes.values())):
            if node.process.poll() is None:
                node.process.terminate()
        give_up = time.monotonic() + 15.0
        for node in self.nodes.values():
            try:
                node.process.wait(max(give_up - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
        _kill_namespace_rest()
        if self.keep_logs is not None:
            logs = self.root / "ray" / "session_latest" / "logs"
            shutil.copytree(logs, self.keep_logs / "ray", dirs_exist_ok=True)
            for node in self.nodes.values():
                shutil.copy(node.log, self.keep_logs / node.log.name)
        for _ in range(3):  # a dying process may still write a log line meanwhile
            shutil.rmtree(self.root, ignore_errors=True)
            if not self.root.exists():
                break
            time.sleep(1.0)  # retrying

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- raystream on the cluster ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_CONFIG = ROOT / "deploy" / "serve_config.cluster.yaml"
APP = "raystream"
GRPC_PORT = 29000


def start_three_nodes(cluster: LoopbackCluster) -> None:
    """The layout deploy/serve_config.cluster.yaml is for, at its smallest: a head that runs
    the ingress, a decode node and an inference node (room for two Inference replicas)."""
    cluster.start_head(1, {"raystream_ingress": 1, "node_head": 1})
    cluster.add_node("a", 1, {"raystream_decode": 1, "node_a": 1})
    cluster.add_node("b", 2, {"raystream_inference": 1, "node_b": 1})


def add_spare_node(cluster: LoopbackCluster) -> None:
    """A worker that can run every stage but the ingress (node c): where Serve restarts the
    replicas of a lost node, as a cluster's autoscaler would provide one."""
    cluster.add_node("c", 2, {"raystream_decode": 1, "raystream_inference": 1, "node_c": 1})


@dataclass(frozen=True)
class Deployed:
    """Where the deployed raystream answers, and what a client needs: the server's
    certificate (its own root) and the bearer token."""

    target: str
    root_certificate: bytes
    token: str


def deploy_raystream(
    cluster: LoopbackCluster,
    model_repository: Path,
    deployments: dict | None = None,
    args: dict | None = None,
) -> Deployed:
    """deploy/serve_config.cluster.yaml as a cluster user deploys it: with the model
    repository's absolute path, a TLS certificate and a token of its own, and the port; each
    entry of `deployments` (name -> settings) updates that deployment's settings, `args` the
    application's. Waits until the application runs."""
    import yaml
    from certificates import issue_certificate, write_pem

    config = yaml.safe_load(CLUSTER_CONFIG.read_text())
    app = config["applications"][0]
    # One certificate and token per cluster: the ingress reads them when it starts, so a
    # redeploy that leaves it running must find the same ones.
    key_path, cert_path = cluster.root / "tls.key", cluster.root / "tls.pem"
    token_path = cluster.root / "grpc-token"
    if not token_path.exists():
        key, cert = issue_certificate("raystream", ca=False)
        write_pem(cluster.root / "tls", key, cert)
        token_path.write_text(secrets.token_urlsafe(24) + "\n")
    token = token_path.read_text().strip()
    app["args"].update(
        port=GRPC_PORT,
        model_repository=str(model_repository.resolve()),
        security={
            "tls_cert": str(cert_path),
            "tls_key": str(key_path),
            "auth_token_file": str(token_path),
        },
        **(args or {}),
    )
    for d in app["deployments"]:
        d.update((deployments or {}).get(d["name"], {}))
    path = cluster.root / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    before = (cluster.applications().get(APP) or {}).get("last_deployed_time_s")
    cluster.serve_deploy(path)
    wait_for(
        lambda: (cluster.applications().get(APP) or {}).get("last_deployed_time_s") != before,
        60,
        what="Serve taking the new config",
    )
    cluster.wait_running(APP)
    return Deployed(f"{HOST}:{GRPC_PORT}", cert_path.read_bytes(), token)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ancestors() -> set[int]:
    found, pid = set(), os.getpid()
    while pid > 1:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def namespace_processes() -> list[int]:
    """Every process in this network namespace but this one and its ancestors."""
    mine, keep = os.readlink("/proc/self/ns/net"), _ancestors()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(entry / "ns/net") == mine and int(entry.name) not in keep:
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _kill_namespace_rest(grace_s: float = 5.0) -> None:
    if not in_private_network():  # never outside a namespace made for the cluster
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in namespace_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        give_up = time.monotonic() + grace_s
        while namespace_processes() and time.monotonic() < give_up:
            time.sleep(0.2)  # polling


def listening_sockets() -> list[tuple[str, int, str]]:
    """Every listening TCP socket of this network namespace: (address, port, the name of
    the process that holds it)."""
    owners = {}
    for pid in [*namespace_processes(), os.getpid()]:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[int(target[8:-1])] = comm(pid)
        except OSError:  # gone, or not ours to read
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)  # 32-bit words in host byte order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(words)
            if getattr(address, "ipv4_mapped", None):
                address = address.ipv4_mapped
            found.append((str(address), int(port, 16), owners.get(int(fields[9]), "?")))
    return found


class Tap:
    """Every TCP payload on loopback to or from `ports` while it runs (a raw packet socket on
    `lo`, as tcpdump would read it): what anyone on the cluster's network could see."""

    def __init__(self, ports: range) -> None:
        self.ports = ports
        self.payload = bytearray()
        self.packets = 0
        self._socket = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self._socket.bind(("lo", 0))
        self._socket.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> Tap:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                frame, (_, _, kind, *_) = self._socket.recvfrom(1 << 16)
            except TimeoutError:
                continue
            if kind == socket.PACKET_OUTGOING:  # each loopback packet comes twice: once
                continue
            ip = frame[14:]  # lo's frames carry an Ethernet header of zeros
            if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_TCP:
                continue
            tcp = ip[(ip[0] & 0x0F) * 4 :]
            source, target = int.from_bytes(tcp[0:2], "big"), int.from_bytes(tcp[2:4], "big")
            if source in self.ports or target in self.ports:
                self.packets += 1
                self.payload += tcp[(tcp[12] >> 4) * 4 :]


class PortCut:
    """Every TCP packet to or from `port` on loopback dropped while it is on, as a firewall
    would drop a node's ports: the process behind it runs on, nothing reaches it or comes
    back. Traffic control on this namespace's `lo` (htb and u32; this kernel has neither
    nftables nor tc's drop action): the port's packets go to a class of 8 bits a second
    with a queue of one packet; every other packet goes on."""

    def __init__(self, port: int) -> None:
        self.port = port

    def on(self) -> None:
        for command in (
            "qdisc add dev lo root handle 1: htb default 1",
            "class add dev lo parent 1: classid 1:1 htb rate 100gbit",
            "class add dev lo parent 1: classid 1:2 htb rate 8bit ceil 8bit",
            "qdisc add dev lo parent 1:2 handle 20: pfifo limit 1",
            *(
                f"filter add dev lo parent 1: protocol ip prio 1 u32 match ip {way} {self.port} "
                "0xffff flowid 1:2"
                for way in ("dport", "sport")
            ),
        ):
            subprocess.run(["tc", *command.split()], check=True, capture_output=True)

    def off(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def wait_for(check, timeout: float, every: float = 0.5, what: str = "condition"):
    """Poll `check()` until it returns something true; that value."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        value = check()
        if value:
            return value
        time.sleep(every)  # polling
    raise TimeoutError(f"{what} not met within {timeout:.0f} s")


def urlopen_error(url: str, headers: dict | None = None) -> int | None:
    """The HTTP status of GET `url` if it fails (401, 403, ...); None if it succeeds."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10):
            return None
    except urllib.error.HTTPError as exc:
        return exc.code
