"""Keep the local Ray that `raystream serve` starts (through `serve run`) on 127.0.0.1.

Ray 2.60 gives a node the machine's network address whenever multi-node clusters are
enabled (the default on Linux), even when told `--node-ip-address=127.0.0.1`
(ray._private.services.resolve_ip_for_localhost), and then binds its GCS, raylet, object
manager, workers and dashboard agent on every interface, the metrics agent's Prometheus
export (every raystream metric, no authentication) included. With multi-node clusters
turned off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as Ray does on macOS and Windows) the node's
address is 127.0.0.1, and every Ray server binds it: GCS, raylet, object manager, core
workers, dashboard (already 127.0.0.1), dashboard agent, runtime-env agent, the metrics
export and the dashboard's and autoscaler's metrics ports. One server ignores the node's
address: each Serve replica's inter-deployment gRPC server binds [::]:0
(ray/serve/_private/replica.py); the worker setup hook below binds it to the node's address.

Exposing metrics to a Prometheus elsewhere is opt-in: `raystream serve --expose-metrics
[HOST:]PORT` (or RAYSTREAM_EXPOSE_METRICS) serves Ray's Prometheus text at
http://HOST:PORT/metrics, copied from the local metrics agent; Ray itself stays on loopback.
"""

from __future__ import annotations

import http.server
import os
import socket
import sys
import threading
import urllib.error
import urllib.request

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
# ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: a worker process runs the
# function it names ("module.function") before its first task (ray/_private/workers/
# default_worker.py). The public way, runtime_env={"worker_process_setup_hook": ...}, is
# not taken from the environment of `serve run`; this variable reaches every worker.
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def loopback_env() -> dict[str, str]:
    """Environment for a process that starts, or joins as a driver, a local Ray kept on
    127.0.0.1. A driver needs it too: Ray rewrites a 127.0.0.1 address given to
    ray.init(address=...) to the machine's address unless multi-node clusters are off."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        SETUP_HOOK_ENV: f"{__name__}.bind_on_node_ip",
    }


def bind_on_node_ip() -> None:
    """Ray worker setup hook: on a node whose address is loopback, gRPC servers that a worker
    would bind on every interface ([::] or 0.0.0.0; Serve's inter-deployment server) bind
    the node's address instead. Never raises: a failing hook would stop the worker."""
    try:
        import ray
        from ray._common import tls_utils

        node_ip = ray.util.get_node_ip_address()
        original = tls_utils.add_port_to_grpc_server
    except Exception:
        return
    if node_ip not in LOOPBACK_HOSTS or getattr(original, "binds_node_ip", False):
        return
    host = f"[{node_ip}]" if ":" in node_ip else node_ip

    def add_port_to_grpc_server(server, address: str):
        bind, sep, port = address.rpartition(":")
        if sep and bind in ("[::]", "0.0.0.0", ""):
            address = f"{host}:{port}"
        return original(server, address)

    add_port_to_grpc_server.binds_node_ip = True
    tls_utils.add_port_to_grpc_server = add_port_to_grpc_server
    # Modules that imported the function by name before the hook ran (none did in 2.60)
    replica = sys.modules.get("ray.serve._private.replica")
    if replica is not None:
        replica.add_port_to_grpc_server = add_port_to_grpc_server


def parse_listen_address(text: str) -> tuple[str, int]:
    """[HOST:]PORT -> (host, port); host 0.0.0.0 (every interface) when not given."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "0.0.0.0"
    value = int(port)  # ValueError for the caller to report
    if not 1 <= value <= 65535:
        raise ValueError(f"port must be in 1..65535, got {value}")
    return host, value


class MetricsForwarder:
    """Serves GET /metrics on (host, port) by fetching the local Ray metrics agent's
    Prometheus text (http://127.0.0.1:<upstream>/metrics); 503 until `upstream` is set.
    Only the metrics leave the machine: Ray's own ports stay on loopback."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream: int | None = None
        forwarder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                if forwarder.upstream is None:
                    self.send_error(503, "Ray's metrics agent is not known yet")
                    return
                url = f"http://127.0.0.1:{forwarder.upstream}/metrics"
                try:
                    with urllib.request.urlopen(url, timeout=10) as reply:
                        body, kind = reply.read(), reply.headers.get("Content-Type")
                except (OSError, urllib.error.URLError) as exc:
                    self.send_error(502, f"Ray's metrics agent did not answer: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind or "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # no line per scrape
                pass

        server_class = http.server.ThreadingHTTPServer
        if ":" in host:  # an IPv6 address
            server_class = type("V6Server", (server_class,), {"address_family": socket.AF_INET6})
        self.server = server_class((host, port), Handler)
        self.server.daemon_threads = True
        self.address = f"{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="metrics").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def expose_metrics_setting(flag: str | None) -> str | None:
    """The --expose-metrics value, else RAYSTREAM_EXPOSE_METRICS; None (off) by default."""
    return flag or os.environ.get("RAYSTREAM_EXPOSE_METRICS") or None
