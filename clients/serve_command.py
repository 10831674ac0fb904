"""`raystream serve`: validate the Serve config, run `serve run` on it in the foreground,
and say when the server is serving: the gRPC health service answers SERVING (over TLS where
the server uses it) and Serve reports the application RUNNING (every replica up, not only
the first to answer). The local Ray that `serve run` starts listens on 127.0.0.1 only
(clients/local_ray.py); --expose-metrics serves Ray's Prometheus metrics beyond it.

`raystream reconfigure`: change the running application's batching `user_config` without a
restart, the way `serve deploy` applies an edited config; a change the replicas would refuse
is refused before anything reaches the cluster."""

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

from clients import local_ray


class ConfigError(Exception):
    """The Serve config is missing or invalid; the message names the field and value."""


def _serve_config(path: Path, overrides: dict) -> tuple[dict, object]:
    import yaml

    from serve_app.config import BY_VALUE_ENV, AppConfig
    from serve_app.pipeline.autoscaling import POLICY

    if not path.is_file():
        raise ConfigError(f"Serve config {path} not found")
    config = yaml.safe_load(path.read_text())
    app = config["applications"][0]
    args = dict(app.get("args") or {})
    for key, value in overrides.items():  # nested sections (engine: {...}) merge, not replace
        merge = isinstance(value, dict) and isinstance(args.get(key), dict)
        args[key] = {**args[key], **value} if merge else value
    app["args"] = args
    deployments = app.get("deployments") or []
    if "topology" in args:  # settings of deployments that this topology does not make go
        from serve_app.config import deployment_names

        made = {"Ingress", "Inference", *deployment_names(args["topology"])}
        deployments = [d for d in deployments if d.get("name") in made]
    env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    for name, value in BY_VALUE_ENV.items():  # a value the config sets wins
        env_vars.setdefault(name, value)
    if args.get("topology") == "direct":
        from serve_app.app import DIRECT_REPLICA_ENV

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
    for d in deployments:  # autoscaled stage deployments count their port calls too
        autoscaled = d.get("autoscaling_config") or d.get("num_replicas") == "auto"
        if d.get("name") != "Ingress" and autoscaled:
            autoscaling = d["autoscaling_config"] = d.get("autoscaling_config") or {}
            autoscaling.setdefault("policy", {"policy_function": POLICY})
    app["deployments"] = deployments
    # No access-log line per handle call (Serve's default) unless the config asks for one:
    # the ingress logs requests itself (log_sample_rate, failures).
    app.setdefault("logging_config", {}).setdefault("enable_access_log", False)
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
        pinned = app.default_model_versions  # a models entry's versions, else the highest
        resolve(app.model_repository, app.model, pinned[0] if pinned else "")
    except ModelNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    batching = "Ingress" if app.topology == "direct" else "Inference"
    for deployment in config["applications"][0]["deployments"]:
        if deployment.get("name") == batching:
            problem = _batching_problem(
                deployment.get("user_config") or {}, app.engine.batch_capacity, args.config
            )
            if problem is not None:
                raise ConfigError(f"invalid {batching} user_config in {args.config}: {problem}")
    _check_port_free(app.host, app.port)
    probe = _Probe(app, args)
    metrics = _metrics_forwarder(args)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its log lines as they happen
    _restore_grpc_verbosity(env, getattr(args, "grpc_verbosity", None))
    if not os.environ.get("RAY_ADDRESS"):  # a local Ray that `serve run` starts: loopback only
        env.update(local_ray.loopback_env())
        # and Ray's token authentication (Ray's own default for a local instance, asked for
        # explicitly; RAY_AUTH_MODE=disabled in the environment still turns it off)
        env.setdefault("RAY_AUTH_MODE", "token")
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
        env=env,
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

    def alive() -> bool:
        return child.poll() is None and fatal.error is None

    def stop(status: int) -> int:
        child.send_signal(signal.SIGINT)
        child.wait()
        return status

    running = helper = None
    try:
        # Asking Serve whether every replica runs needs a process that joins the cluster as a
        # driver (several seconds on a cold host): started as soon as Ray runs, it waits
        # alongside the replicas' start instead of after it.
        cluster = _cluster_address(child.pid, alive, args.ready_timeout)
        if cluster is not None:
            helper = _running_helper(config["applications"][0]["name"], cluster, args.ready_timeout)
        if probe.reason is not None:
            print(
                f"raystream starting with TLS on {address}; readiness over gRPC is not probed: "
                f"{probe.reason}",
                flush=True,
            )
            answered = False
        else:
            remaining = args.ready_timeout - (time.monotonic() - started)
            answered = asyncio.run(probe.wait_serving(address, remaining, alive))
            if probe.reason is not None:  # TLS that the probe could not verify
                print(f"raystream: readiness over gRPC is not probed: {probe.reason}", flush=True)
        if helper is not None and alive() and (answered or probe.reason is not None):
            # Health answers as soon as one replica listens; with several replicas (or
            # replicas compiling their engines) the rest may still be starting.
            running = _running_report(
                helper, args.ready_timeout - (time.monotonic() - started), alive
            )
        if fatal.error is not None:
            print(f"raystream: cannot start: {fatal.error}", file=sys.stderr, flush=True)
            return stop(1)
        if child.poll() is not None:
            return child.wait()
        if not answered and probe.reason is None:
            print(
                f"raystream: not ready after {args.ready_timeout:.0f} s; see the Serve log "
                f"above. Stopping.",
                file=sys.stderr,
                flush=True,
            )
            return stop(1)
        if not answered and running is None:
            print(
                f"raystream: gRPC with TLS on {address} is not probed, and Serve did not say "
                f"the application is running; see the Serve log above. Ctrl-C stops",
                file=sys.stderr,
                flush=True,
            )
            return child.wait()
        if answered:
            described = asyncio.run(probe.describe(address, app))
        else:
            described = f"model {app.model}, engine {app.engine.kind}, topology {app.topology}"
        if running is None:
            print(
                "raystream: could not ask Serve whether every replica is up; at least one answers",
                file=sys.stderr,
                flush=True,
            )
        else:
            replicas = ", ".join(f"{name} {n}" for name, n in running["replicas"].items())
            described += f"; replicas running: {replicas}; Ray cluster {cluster}"
            if metrics is not None:
                metrics.upstream = running.get("metrics_export_port")
        if metrics is not None:
            described += f"; Ray metrics on http://{metrics.address}/metrics"
        tls = " (TLS)" if app.security.tls_cert is not None else ""
        print(f"raystream ready: gRPC{tls} on {address}, {described}; Ctrl-C stops", flush=True)
        return child.wait()
    except KeyboardInterrupt:
        # Ctrl-C in a terminal reaches the whole process group, `serve run` too, which then
        # shuts down by itself: a second SIGINT would cut that short ("Aborted!", exit 1). A
        # SIGINT sent to this process alone (kill -INT, a background job) is passed on.
        if not fatal.stopping.wait(3.0):
            child.send_signal(signal.SIGINT)
        return child.wait()
    except BaseException:
        stop(1)  # never leave a server running behind a failure
        raise
    finally:
        os.unlink(f.name)
        if helper is not None and helper.poll() is None:  # not ready, or stopped early
            helper.kill()
        if metrics is not None:
            metrics.close()


def _restore_grpc_verbosity(env: dict[str, str], inherited: str | None) -> None:
    """The server logs what grpc logs by default: undo the CLI's quieter setting
    (`inherited`: GRPC_VERBOSITY as the CLI found it, which the CLI passes in `args`)."""
    env.pop("GRPC_VERBOSITY", None)
    if inherited is not None:
        env["GRPC_VERBOSITY"] = inherited


def _metrics_forwarder(args: argparse.Namespace) -> local_ray.MetricsForwarder | None:
    """The opt-in Prometheus endpoint for a scraper elsewhere (--expose-metrics, or
    RAYSTREAM_EXPOSE_METRICS), bound before anything starts; None when not asked for."""
    setting = local_ray.expose_metrics_setting(getattr(args, "expose_metrics", None))
    if setting is None:
        return None
    try:
        host, port = local_ray.parse_listen_address(setting)
        return local_ray.MetricsForwarder(host, port)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--expose-metrics {setting}: {exc}") from None


class _Probe:
    """How `raystream serve` asks its server whether it serves: the gRPC health service,
    over TLS with the server's own certificate as the root (grpc trusts the certificate it
    is given, self-signed or issued by a CA) and the name the certificate gives. `reason`
    says why it cannot probe (a server that requires client certificates and none given to
    probe with, or a certificate that does not verify, e.g. expired); None when it can."""

    def __init__(self, app, args: argparse.Namespace) -> None:
        security = app.security
        self.reason: str | None = None
        self.credentials: grpc.ChannelCredentials | None = None
        self.options: list[tuple[str, object]] = []
        self.token_auth = security.auth_token_file is not None
        if security.tls_cert is None:
            return
        cert, key = getattr(args, "probe_tls_cert", None), getattr(args, "probe_tls_key", None)
        if security.tls_client_ca is not None and not (cert and key):
            self.reason = (
                "the server requires client certificates (security.tls_client_ca) and none "
                "was given to probe with (--probe-tls-cert, --probe-tls-key)"
            )
            return
        try:
            roots = security.tls_cert.read_bytes()
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=roots,
                private_key=Path(key).read_bytes() if key else None,
                certificate_chain=Path(cert).read_bytes() if cert else None,
            )
        except OSError as exc:
            raise ConfigError(f"cannot read a TLS file: {exc}") from None
        name = _certificate_name(roots)
        if name is not None:  # the probe dials host:port; the certificate names the server
            self.options.append(("grpc.ssl_target_name_override", name))

    def channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=self.options)
        return grpc.aio.secure_channel(address, self.credentials, options=self.options)

    async def wait_serving(self, address: str, timeout: float, alive: Callable[[], bool]) -> bool:
        """Poll the health service (open even with token auth) until SERVING: True; False if
        `alive()` turns false or `timeout` passes; False with `reason` set if the server's
        TLS certificate cannot be verified (then waiting longer would not help)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = asyncio.get_running_loop().time() + timeout
        async with self.channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while alive() and asyncio.get_running_loop().time() < deadline:
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return True
                except grpc.aio.AioRpcError as exc:
                    details = exc.details() or ""
                    if self.credentials is not None and _UNVERIFIABLE.search(details):
                        self.reason = f"the server's certificate does not verify: {details}"
                        return False
                await asyncio.sleep(0.5)
        return False

    async def describe(self, address: str, app) -> str:
        """What is served, from GetModelInfo (open unless token auth is on); from the config
        where the server cannot be asked."""
        from raystream.v1 import classifier_pb2 as pb
        from raystream.v1 import classifier_pb2_grpc as pb_grpc

        fallback = f"model {app.model}, engine {app.engine.kind}, topology {app.topology}"
        if self.token_auth:
            return fallback
        try:
            async with self.channel(address) as channel:
                stub = pb_grpc.ImageClassifierStub(channel)
                info = await stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5.0)
        except grpc.aio.AioRpcError:
            return fallback
        route = f", route {' | '.join(info.route)}" if info.route else ""
        return (
            f"model {info.name}/{info.version}, engine {info.engine} ({info.precision}), "
            f"topology {app.topology}{route}"
        )


# grpc's details when the server's certificate does not verify, or does not name the host
_UNVERIFIABLE = re.compile(r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|Peer name", re.I)


def _certificate_name(pem: bytes) -> str | None:
    """A DNS name the first certificate in `pem` is for (its first DNS subject alternative
    name, else its common name); None if it names none or `cryptography` is missing."""
    try:
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        cert = x509.load_pem_x509_certificates(pem)[0]
    except Exception:  # not installed (a dev dependency), or not PEM: no override
        return None
    try:
        names = cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    for name in names:
        if isinstance(name, str) and name:
            return "raystream." + name[2:] if name.startswith("*.") else name
    return None


def _cluster_address(serve_pid: int, alive: Callable[[], bool], timeout: float) -> str | None:
    """The GCS address of the Ray instance that `serve run` (process `serve_pid`) started,
    once its raylet runs (within `timeout`, while `alive()`). RAY_ADDRESS when `serve run`
    joined an existing cluster; None when neither is found."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        address = _raylet_gcs_address(serve_pid)
        if address is not None:
            return address
        time.sleep(0.5)
    return None


def _raylet_gcs_address(serve_pid: int) -> str | None:
    """The --gcs-address flag of the raylet child of `serve_pid` (Linux /proc). Other Ray
    instances may run on the machine (a test session's, say), so "auto" could pick the
    wrong one."""
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
    return None


def _driver_env(address: str | None) -> dict[str, str]:
    """Environment for a driver joining the Ray cluster at `address`: token auth unless the
    environment turns it off (a Ray instance started by `serve run` uses it, and a driver
    given an explicit address assumes no auth unless told), and, for a cluster on loopback,
    what keeps Ray from rewriting 127.0.0.1 to the machine's address."""
    env = {"RAY_AUTH_MODE": "token", **os.environ}
    host = (address or "").rpartition(":")[0].strip("[]")
    if host in local_ray.LOOPBACK_HOSTS or address in (None, "auto"):
        env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return env


def _running_helper(app_name: str, address: str, timeout: float) -> subprocess.Popen:
    """A helper process that joins the Ray cluster at `address` as a driver (no dashboard
    needed) and, once Serve reports `app_name` RUNNING, prints {"replicas": running per
    deployment, "metrics_export_port": the metrics agent's port} (`_running_report`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "clients.serve_command", app_name, address, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_driver_env(address),
    )


def _running_report(
    helper: subprocess.Popen, timeout: float, alive: Callable[[], bool]
) -> dict | None:
    """What the helper printed; None if Serve could not be asked, `alive()` turned false,
    or `timeout` passed first."""
    give_up = time.monotonic() + max(timeout, 1.0) + 30.0  # joining the cluster may hang
    try:
        while helper.poll() is None:
            if not alive() or time.monotonic() > give_up:
                helper.kill()
            time.sleep(0.2)
    finally:  # Ctrl-C meanwhile
        if helper.poll() is None:
            helper.kill()
    lines = helper.stdout.read().splitlines()
    return json.loads(lines[-1]) if helper.returncode == 0 and lines else None


def _report_when_running(app_name: str, address: str, timeout: float) -> int:
    """The helper of `_running_helper`: prints its answer as JSON. Started while Serve may
    not run yet: asks again until it does."""
    import ray
    from ray import serve

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = serve.status().applications.get(app_name)
        except Exception:  # Serve's controller not started yet
            status = None
        if status is not None and status.status == "RUNNING":
            counts = {
                name: deployment.replica_states.get("RUNNING", 0)
                for name, deployment in status.deployments.items()
            }
            node = next((n for n in ray.nodes() if n.get("Alive")), {})
            answer = {"replicas": counts, "metrics_export_port": node.get("MetricsExportPort")}
            print(json.dumps(answer), flush=True)
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
    # Lines Ray 2.60 prints on every start or stop that say nothing is wrong, dropped:
    # - Serve's controller deregisters the autoscaling state of every deployment it deploys
    #   or removes, autoscaled or not, and warns for each that never had one
    #   (ray/serve/_private/autoscaling_state.py, deregister_deployment);
    # - serve.shutdown() waits on the controller's graceful_shutdown, a task with infinite
    #   retries that ends by the controller killing itself, and the raylet reports that
    #   task as failed "so the task will be retried" (it is not: Ray is stopping).
    NOISE = re.compile(
        r"Cannot deregister autoscaling state for deployment .* because it is not registered"
        r"|Task ServeController\.graceful_shutdown failed\. There are infinite retries"
    )

    STOPPING = "Got KeyboardInterrupt, shutting down"  # `serve run` took a SIGINT

    def __init__(self, output) -> None:
        self.error: str | None = None
        self.stopping = threading.Event()
        self._output = output
        threading.Thread(target=self._pump, daemon=True, name="serve-output").start()

    def _pump(self) -> None:
        for line in self._output:
            if self.NOISE.search(line):
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
            if self.STOPPING in line:
                self.stopping.set()
            match = self.PATTERN.search(line)
            if match and self.error is None:
                self.error = (match.group(2) or f"{match.group(3)}: is the port in use?").strip()


def _batching_problem(user_config: dict, engine_max: int, config_path: Path) -> str | None:
    """Why `user_config` is not a batching config the replicas would take, in one line naming
    the field and its allowed range; None if they would. A replica refuses a max_batch_size
    past its engine's (the app config's engine.batch_capacity), and Serve, seeing every
    replica fail, would replace them all: so this is checked before anything is deployed."""
    from pydantic import ValidationError

    from serve_app.config import BatchingConfig

    def bounds(field: str) -> tuple[object, object]:
        low = high = None
        info = BatchingConfig.model_fields.get(field)
        for item in info.metadata if info else ():
            low = getattr(item, "ge", None) if getattr(item, "ge", None) is not None else low
            high = getattr(item, "le", None) if getattr(item, "le", None) is not None else high
        return low, high

    def allowed(field: str, value: object) -> str:
        low, high = bounds(field)
        if field == "max_batch_size":
            return (
                f"max_batch_size must be in 1..{engine_max} (engine.batch_capacity in "
                f"{config_path}), got {value}"
            )
        if low is not None and high is not None:
            return f"{field} must be in {low}..{high}, got {value}"
        if low is not None:
            return f"{field} must be at least {low}, got {value}"
        return f"{field} must be at most {high}, got {value}"

    try:
        batching = BatchingConfig.model_validate(user_config)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            if error["type"] in ("greater_than_equal", "less_than_equal"):
                problems.append(allowed(field, error["input"]))
            elif error["type"] == "extra_forbidden":
                keys = ", ".join(BatchingConfig.model_fields)
                problems.append(f"unknown key {field!r} (keys: {keys})")
            elif field:
                problems.append(f"{field}: {error['msg']}, got {error['input']!r}")
            else:  # a check across fields
                problems.append(error["msg"].removeprefix("Value error, "))
        return "; ".join(problems)
    if batching.max_batch_size > engine_max:
        return allowed("max_batch_size", batching.max_batch_size)
    return None


def cmd_reconfigure(args: argparse.Namespace) -> int:
    """Apply KEY=VALUE changes to the batching user_config of the application that
    `raystream serve` started with the same config and flags, through Serve's deploy (each
    replica's `reconfigure`; no restart, since nothing else differs). A change the replicas
    would refuse is refused here, before anything reaches the cluster."""
    # As _running_helper's process (_driver_env): token auth, and a loopback address kept as it
    # is; Ray reads both when first imported. Set first: _serve_config imports Ray for
    # topology direct.
    for name, value in _driver_env(args.address).items():
        os.environ.setdefault(name, value)
    import yaml

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
        try:
            user_config[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{change!r}: {value!r} is not a YAML value") from None
        if user_config[key] is None:  # null: back to BatchingConfig's default
            del user_config[key]
    problem = _batching_problem(user_config, app.engine.batch_capacity, args.config)
    if problem is not None:
        raise ConfigError(f"refused, nothing changed: {problem}")

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _check_reachable(args.address)
    try:
        ray.init(address=args.address, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot reach the Ray cluster at {args.address} ({reason}); is `raystream serve` "
            f"running? Its ready line names the cluster to pass as --address"
        ) from None
    try:
        serve.start(proxy_location=config.get("proxy_location", "Disabled"))  # the running one
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        _wait_applied(config["applications"][0]["name"], name, args.timeout)
    except ConfigError:
        raise
    except Exception as exc:  # a Ray or Serve failure: one line, the server log has the rest
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"the deploy failed ({type(exc).__name__}: {reason}); see the server's log"
        ) from None
    print(f"raystream: {name} user_config now {user_config}", flush=True)
    return 0


def _check_reachable(address: str) -> None:
    """A Ray address that nothing listens on: ray.init would retry it for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray parses itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3.0).close()
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address} ({exc.strerror or exc}); is `raystream "
            f"serve` running? Its ready line names the cluster to pass as --address"
        ) from None


def _wait_applied(app_name: str, deployment: str, timeout: float) -> None:
    """Wait until Serve reports `app_name` RUNNING after a deploy; ConfigError (one line) if
    it fails or `timeout` passes first. Serve's own blocking deploy waits a minute even once
    the application has failed, then raises TimeoutError."""
    from ray import serve

    start = time.monotonic()
    while True:
        time.sleep(0.5)
        status = serve.status().applications.get(app_name)
        if status is None:
            raise ConfigError(f"application {app_name!r} is not running on this Ray cluster")
        if status.status == "DEPLOY_FAILED":
            lines = [line for line in status.message.splitlines() if line.strip()]
            raise ConfigError(
                f"the deploy failed: {lines[-1] if lines else 'no reason given'}; see the "
                f"server's log"
            )
        # The controller applies a new config on its next loop: give it a moment before
        # taking RUNNING as the new config's (one loop is ~0.1 s).
        if status.status == "RUNNING" and time.monotonic() - start >= 1.0:
            return
        if time.monotonic() - start > timeout:
            state = status.deployments.get(deployment)
            detail = f"; {deployment}: {state.status}" if state is not None else ""
            raise ConfigError(
                f"{app_name} is not RUNNING {timeout:.0f} s after the deploy (now "
                f"{status.status}{detail}); see the server's log"
            )


if __name__ == "__main__":  # python -m clients.serve_command APP ADDRESS TIMEOUT: _running_helper
    sys.exit(_report_when_running(sys.argv[1], sys.argv[2], float(sys.argv[3])))
