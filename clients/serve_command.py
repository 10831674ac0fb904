"""`raystream serve`: validate the Serve config, run `serve run` on it in the foreground,
and say when the server is serving: the gRPC health service answers SERVING and Serve
reports the application RUNNING (every replica up, not only the first to answer).

`raystream reconfigure`: change the running application's batching `user_config` without a
restart, the way `serve deploy` applies an edited config."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc


class ConfigError(Exception):
    """The Serve config is missing or invalid; the message names the field and value."""


def _serve_config(path: Path, overrides: dict) -> tuple[dict, object]:
    import yaml

    from serve_app.config import AppConfig

    if not path.is_file():
        raise ConfigError(f"Serve config {path} not found")
    config = yaml.safe_load(path.read_text())
    app = config["applications"][0]
    args = dict(app.get("args") or {})
    for key, value in overrides.items():  # nested sections (engine: {...}) merge, not replace
        merge = isinstance(value, dict) and isinstance(args.get(key), dict)
        args[key] = {**args[key], **value} if merge else value
    app["args"] = args
    deployments = app.get("deployments", [])
    if args.get("topology") in ("fused", "direct"):  # these exist only in topology chained
        deployments = [d for d in deployments if d.get("name") not in ("Preprocess", "Postprocess")]
    if args.get("topology") == "direct":
        from serve_app.app import DIRECT_REPLICA_ENV

        env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
        for name, value in DIRECT_REPLICA_ENV.items():
            env_vars.setdefault(name, value)
        # The ingress replicas host the model: they take Inference's batching and GPUs.
        inference = next((d for d in deployments if d.get("name") == "Inference"), {})
        deployments = [d for d in deployments if d.get("name") != "Inference"]
        for d in deployments:
            if d.get("name") == "Ingress":
                if "user_config" in inference:
                    d.setdefault("user_config", inference["user_config"])
                gpus = inference.get("ray_actor_options", {}).get("num_gpus")
                if gpus:
                    # A redeploy starts the surge's replicas before the old ones stop; with
                    # no GPU share left for them it never finishes. Ray's share is
                    # bookkeeping, so ask for less and leave that room.
                    gpus /= 1 + d.get("max_surge_percent", 0) / 100
                    d.setdefault("ray_actor_options", {}).setdefault("num_gpus", gpus)
    app["deployments"] = deployments
    try:
        validated = AppConfig.model_validate(app["args"])
    except ValueError as exc:
        raise ConfigError(f"invalid config {path}:\n{exc}") from None
    return config, validated


def _check_port_free(host: str, port: int) -> None:
    """The ingress listens with SO_REUSEPORT (so a redeploy can overlap the old replica), so
    a second server on a busy port would silently share it: refuse before starting."""
    probe = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    with socket.socket(socket.AF_INET6 if ":" in probe else socket.AF_INET) as s:
        s.settimeout(1.0)
        if s.connect_ex((probe, port)) == 0:
            raise ConfigError(
                f"something already listens on {host}:{port}; stop it or choose another --port"
            )


def _overrides(args: argparse.Namespace) -> dict:
    """The application args that `raystream serve`'s flags replace in the config."""
    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "model_repository": args.model_repository,
        }.items()
        if v
    }
    if args.engine:
        overrides["engine"] = {"kind": args.engine}
    if args.topology:
        overrides["topology"] = args.topology
    if args.decode:
        overrides["decode"] = args.decode
    return overrides


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the config, start `serve run` in the foreground, print when it answers."""
    import yaml

    from engines.repository import ModelNotFoundError, resolve

    config, app = _serve_config(args.config, _overrides(args))
    try:
        resolve(app.model_repository, app.model, app.model_version)
    except ModelNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    _check_port_free(app.host, app.port)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    # The Serve CLI through this interpreter: works in a venv and on machines where the
    # `serve` console script is not on PATH.
    child = subprocess.Popen(
        [sys.executable, "-m", "ray.serve.scripts", "run", f.name],
        # SIGINT back to its default even where this process was started with it ignored (a
        # background job), so the child turns it into a clean shutdown.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its log lines as they happen
    )
    fatal = _FatalErrorWatch(child.stdout)
    # A shell starts a background job with SIGINT ignored, and Python leaves it ignored:
    # `kill -INT` did nothing to a backgrounded `raystream serve`. Now it stops it as Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # `docker stop`, systemd and Kubernetes send SIGTERM: stop the way Ctrl-C does, so the
    # ingress drains (answers what it read, ends streams with UNAVAILABLE).
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGINT))
    address = f"{app.host}:{app.port}"
    started = time.monotonic()

    async def wait_ready() -> bool:
        """Poll the health service (open even with token auth) until SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = asyncio.get_running_loop().time() + args.ready_timeout
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while (
                child.poll() is None
                and fatal.error is None
                and asyncio.get_running_loop().time() < deadline
            ):
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return True
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.5)
        return False

    try:
        if app.security.tls_cert is not None:
            print(f"raystream starting with TLS on {address}; readiness is not probed", flush=True)
        elif asyncio.run(wait_ready()):
            # Health answers as soon as one replica listens; with several replicas (or
            # replicas compiling their engines) the rest may still be starting.
            cluster = _cluster_address(child.pid)
            running = _wait_running(
                config["applications"][0]["name"],
                cluster,
                args.ready_timeout - (time.monotonic() - started),
                lambda: child.poll() is None and fatal.error is None,
            )
            described = asyncio.run(_describe(address, app))
            if running is None:
                print(
                    "raystream: could not ask Serve whether every replica is up; at least one "
                    "answers",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                replicas = ", ".join(f"{name} {n}" for name, n in running.items())
                described += f"; replicas running: {replicas}; Ray cluster {cluster}"
            print(f"raystream ready: gRPC on {address}, {described}; Ctrl-C stops", flush=True)
        elif fatal.error is not None:
            print(f"raystream: cannot start: {fatal.error}", file=sys.stderr, flush=True)
            child.send_signal(signal.SIGINT)
            child.wait()
            return 1
        elif child.poll() is None:
            print(
                f"raystream: not ready after {args.ready_timeout:.0f} s; see the Serve log "
                f"above. Stopping.",
                file=sys.stderr,
                flush=True,
            )
            child.send_signal(signal.SIGINT)
            child.wait()
            return 1
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        return child.wait()
    except BaseException:
        child.send_signal(signal.SIGINT)  # never leave a server running behind a failure
        child.wait()
        raise
    finally:
        os.unlink(f.name)


def _cluster_address(serve_pid: int) -> str | None:
    """The GCS address of the Ray instance that `serve run` (process `serve_pid`) started:
    the --gcs-address flag of its raylet child (Linux /proc). Other Ray instances may run on
    the machine (a test session's, say), so "auto" could pick the wrong one. RAY_ADDRESS when
    `serve run` joined an existing cluster; None when neither is found."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != serve_pid:  # ppid
                continue
            args = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not Linux
            continue
        for arg in args:
            if arg.startswith(b"--gcs-address="):
                return arg.split(b"=", 1)[1].decode()
    return os.environ.get("RAY_ADDRESS") or None


def _wait_running(
    app_name: str, address: str | None, timeout: float, alive: Callable[[], bool]
) -> dict[str, int] | None:
    """Replicas running per deployment once Serve reports `app_name` RUNNING, asked by a
    helper process that joins the Ray cluster at `address` as a driver (no dashboard
    needed); None if there is no address, Serve could not be asked, `alive()` turned false,
    or `timeout` passed first."""
    if address is None:
        return None
    timeout = max(timeout, 1.0)
    helper = subprocess.Popen(
        [sys.executable, "-m", "clients.serve_command", app_name, address, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        # A Ray instance started by `serve run` uses token auth unless the environment turns
        # it off; a driver given an explicit address assumes no auth unless told.
        env={"RAY_AUTH_MODE": "token", **os.environ},
    )
    give_up = time.monotonic() + timeout + 30.0  # joining the cluster may itself hang
    while helper.poll() is None:
        if not alive() or time.monotonic() > give_up:
            helper.kill()
        time.sleep(0.2)
    lines = helper.stdout.read().splitlines()
    return json.loads(lines[-1]) if helper.returncode == 0 and lines else None


def _report_when_running(app_name: str, address: str, timeout: float) -> int:
    """The helper of `_wait_running`: prints {deployment: replicas running} as JSON."""
    import ray
    from ray import serve

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app_name)
        if status is not None and status.status == "RUNNING":
            counts = {
                name: deployment.replica_states.get("RUNNING", 0)
                for name, deployment in status.deployments.items()
            }
            print(json.dumps(counts), flush=True)
            return 0
        time.sleep(0.5)
    return 1


class _FatalErrorWatch:
    """Passes the Serve output through and watches it for errors that retrying a replica
    cannot fix (a missing GPU, model or engine): Serve would retry the constructor for
    minutes; raystream stops at the first one and says why."""

    # ... or an ingress that cannot bind its port: the port was free when `raystream serve`
    # checked, and another process took it before the replica bound it.
    PATTERN = re.compile(
        r"(engines\.base\.EngineError|ModelNotFoundError|ValidationError): (.+)"
        r"|RuntimeError: (Failed to bind to address [^;\s]+)"
    )

    def __init__(self, output) -> None:
        self.error: str | None = None
        self._output = output
        threading.Thread(target=self._pump, daemon=True, name="serve-output").start()

    def _pump(self) -> None:
        for line in self._output:
            sys.stdout.write(line)
            sys.stdout.flush()
            match = self.PATTERN.search(line)
            if match and self.error is None:
                self.error = (match.group(2) or f"{match.group(3)}: is the port in use?").strip()


def cmd_reconfigure(args: argparse.Namespace) -> int:
    """Apply KEY=VALUE changes to the batching user_config of the application that
    `raystream serve` started with the same config and flags, through Serve's deploy (each
    replica's `reconfigure`; no restart, since nothing else differs)."""
    # As _wait_running's helper: a cluster that `serve run` started uses token auth, and a
    # driver given its address must be told so before Ray is first imported (Ray reads the
    # setting then). Set first: _serve_config imports Ray for topology direct.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import yaml

    from serve_app.config import BatchingConfig

    config, app = _serve_config(args.config, _overrides(args))
    name = "Ingress" if app.topology == "direct" else "Inference"  # where batching happens
    deployments = config["applications"][0].setdefault("deployments", [])
    deployment = next((d for d in deployments if d.get("name") == name), None)
    if deployment is None:
        deployment = {"name": name}
        deployments.append(deployment)
    user_config = deployment.setdefault("user_config", {})
    for change in args.changes:
        key, sep, value = change.partition("=")
        if not sep:
            raise ConfigError(f"{change!r}: expected KEY=VALUE, e.g. max_batch_size=16")
        user_config[key] = yaml.safe_load(value)
        if user_config[key] is None:  # null: back to BatchingConfig's default
            del user_config[key]
    try:
        BatchingConfig.model_validate(user_config)
    except ValueError as exc:
        raise ConfigError(f"invalid user_config {user_config}:\n{exc}") from None
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    ray.init(address=args.address, log_to_driver=False, logging_level="WARNING")
    serve.start(proxy_location=config.get("proxy_location", "Disabled"))  # the running one
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config), _blocking=True)
    print(f"raystream: {name} user_config now {user_config}", flush=True)
    return 0


async def _describe(address: str, app) -> str:
    """What is served, from GetModelInfo (open unless token auth is on)."""
    from clients.client import Client

    if app.security.auth_token_file is not None:
        return f"model {app.model}, engine {app.engine.kind}"
    async with Client(address) as client:
        info = await client.model_info(timeout=5.0)
    return (
        f"model {info.name}/{info.version}, engine {info.engine} ({info.precision}), "
        f"topology {app.topology}"
    )


if __name__ == "__main__":  # python -m clients.serve_command APP ADDRESS TIMEOUT: _wait_running
    sys.exit(_report_when_running(sys.argv[1], sys.argv[2], float(sys.argv[3])))
