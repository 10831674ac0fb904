"""The raystream CLI's expected failures, run as a user runs it (a subprocess of the real CLI;
no server): numbers out of range, a reconfigure the replicas would refuse, a server that is
down or that speaks TLS to a plaintext client (and the other way round)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from certificates import issue_certificate, write_pem
from support import run_cli

from conftest import ROOT


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    from skimage import data

    from conftest import encode

    path = tmp_path_factory.mktemp("photos") / "chelsea.jpg"
    path.write_bytes(encode(data.chelsea()))
    return path


# (subcommand and flags, the flag the line must name); every numeric flag with a range
BAD_NUMBERS = [
    (["classify", "{photo}", "--top-k", "-1"], "--top-k"),
    (["classify", "{photo}", "--top-k", "0"], "--top-k"),
    (["classify", "{photo}", "--top-k", "99999999999"], "--top-k"),
    (["classify", "{photo}", "--batch-size", "0"], "--batch-size"),
    (["classify", "{photo}", "--batch-size", "-3"], "--batch-size"),
    (["classify", "{photo}", "--batch-size", "two"], "--batch-size"),
    (["classify", "{photo}", "--timeout", "-1"], "--timeout"),
    (["classify", "{photo}", "--timeout", "0"], "--timeout"),
    (["classify", "{photo}", "--timeout", "nan"], "--timeout"),
    (["classify", "{photo}", "--timeout", "1e300"], "--timeout"),
    (["classify", "{photo}", "--connections", "0"], "--connections"),
    (["embed", "{photo}", "--out", "v.npy", "--batch-size", "0"], "--batch-size"),
    (["embed", "{photo}", "--out", "v.npy", "--timeout", "nan"], "--timeout"),
    (["embed", "{photo}", "--out", "v.npy", "--connections", "0"], "--connections"),
    (["embed", "{photo}", "--out", "v.npy", "--format", "csv"], "--format"),
    (["similar", "{photo}", "--index", "v.npy", "-k", "0"], "-k"),
    (["similar", "{photo}", "--index", "v.npy", "--timeout", "-1"], "--timeout"),
    (["info", "--timeout", "-5"], "--timeout"),
    (["info", "--timeout", "inf"], "--timeout"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--ready-timeout", "0"], "--ready-timeout"),
    (["reconfigure", "max_batch_size=8", "--port", "70000"], "--port"),
    (["reconfigure", "max_batch_size=8", "--timeout", "-1"], "--timeout"),
    (["bench", "--batch-size", "0"], "--batch-size"),
    (["bench", "--streams", "0"], "--streams"),
    (["bench", "--in-flight", "-2"], "--in-flight"),
    (["bench", "--rate", "0"], "--rate"),
    (["bench", "--rate", "-10"], "--rate"),
    (["bench", "--duration", "0"], "--duration"),
    (["bench", "--requests", "0"], "--requests"),
    (["bench", "--connections", "0"], "--connections"),
    (["bench", "--processes", "0"], "--processes"),
    (["bench", "--processes", "4", "--streams", "2"], "--processes"),
    (["bench", "--top-k", "-1"], "--top-k"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--sweep", "1,0"], "--sweep"),
    (["bench", "--sweep", "1,x"], "--sweep"),
    (["bench", "--sweep", "1.5,2"], "--sweep"),
    (["models", "load", "m", "--latest", "-9"], "--latest"),
    (["models", "load", "m", "--latest", "0"], "--latest"),
    (["models", "load", "m", "--versions", "1,,2", "--server", "127.0.0.1:1"], "--versions"),
    (["build-engine", "--max-batch-size", "0"], "--max-batch-size"),
    (["build-engine", "--max-batch-size", "5000"], "--max-batch-size"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_NUMBERS, ids=lambda a: " ".join(a))
def test_numbers_out_of_range_are_one_line_and_exit_2(args, flag, photo) -> None:
    result = run_cli(*(a.format(photo=photo) for a in args))
    line = _one_line(result)
    assert flag in line and line.startswith("raystream"), line
    assert not result.stdout  # nothing sent, nothing printed


def test_classify_rejects_a_zero_batch_size_instead_of_sending_nothing(photo) -> None:
    """--batch-size 0 used to send no request and then fail printing an empty table."""
    line = _one_line(
        run_cli("classify", str(photo), "--batch-size", "0", "--server", "127.0.0.1:1")
    )
    assert line == (
        "raystream classify: argument --batch-size: must be at least 1, got 0 "
        "(see raystream classify --help)"
    )


# Python run in the CLI's process first: any import of Ray fails (ImportError, a traceback)
NO_RAY = "import sys\nsys.modules['ray'] = None"


@pytest.fixture
def listener():
    """A port that records whether anything connected to it: a stand-in Ray address."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    connected = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):  # a timeout: look at `done` again
                connected.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}", connected
    done.set()
    thread.join()
    server.close()


def test_reconfigure_refuses_a_batch_past_the_engines_before_touching_ray(listener) -> None:
    """max_batch_size past the config's engine.batch_capacity (64): every Inference replica
    would refuse it and Serve would replace them all (minutes of UNAVAILABLE). Refused in
    the CLI, before Ray is imported or the cluster address is dialed."""
    address, connected = listener
    result = run_cli(
        "reconfigure",
        "--model-repository",
        "models",
        "max_batch_size=1000",
        "--address",
        address,
        prelude=NO_RAY,
    )
    line = _one_line(result)
    assert "max_batch_size must be in 1..64" in line and "got 1000" in line, line
    assert "engine.batch_capacity" in line and "nothing changed" in line, line
    assert not connected


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("max_batch_size=0", "max_batch_size must be in 1..64 (engine.batch_capacity"),
        ("batch_wait_timeout_s=11", "batch_wait_timeout_s must be in 0.0..10.0, got 11"),
        ("max_queued_images=-1", "max_queued_images must be at least 1, got -1"),
        ("max_queued_images=many", "max_queued_images: Input should be a valid integer"),
        ("max_batch_sise=8", "unknown key 'max_batch_sise'"),
        ("max_batch_size", "expected KEY=VALUE"),
    ],
)
def test_reconfigure_names_the_field_and_its_range(change, expected, listener) -> None:
    address, connected = listener
    result = run_cli("reconfigure", change, "--address", address, prelude=NO_RAY)
    assert expected in _one_line(result)
    assert not connected


def test_reconfigure_direct_checks_the_ingress_batching(listener) -> None:
    """Topology direct batches in the Ingress: the same limit. (Its config imports Ray, so
    here the check is that the cluster address is never dialed.)"""
    address, connected = listener
    result = run_cli(
        "reconfigure", "--topology", "direct", "max_batch_size=65", "--address", address
    )
    assert "max_batch_size must be in 1..64" in _one_line(result)
    assert not connected


def test_reconfigure_of_a_cluster_that_is_not_there_is_one_line() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    result = run_cli("reconfigure", "max_batch_size=16", "--address", closed, timeout=60)
    line = _one_line(result)
    assert f"cannot reach the Ray cluster at {closed}" in line, line


# Ray faked in the CLI's process: joining the cluster works, then the deploy goes as `deploy`
# says (raise: deploy_apps raises; failed: Serve reports DEPLOY_FAILED; stuck: DEPLOYING).
FAKE_RAY = """
import types, ray, ray.serve, ray.serve.context
ray.init = lambda **kw: None
ray.serve.start = lambda **kw: None
class Client:
    def deploy_apps(self, config):
        if DEPLOY == "raise":
            raise RuntimeError("Failed to apply the config: the controller died\\nTraceback")
status = "DEPLOY_FAILED" if DEPLOY == "failed" else "DEPLOYING"
app = types.SimpleNamespace(
    status=status,
    message="Traceback (most recent call last):\\n  ...\\nValueError: replica refused it",
    deployments={"Inference": types.SimpleNamespace(status="UPDATING")},
)
ray.serve.status = lambda: types.SimpleNamespace(applications={"raystream": app})
ray.serve.context._get_global_client = lambda: Client()
"""


@pytest.mark.parametrize(
    ("deploy", "expected"),
    [
        ("raise", "the deploy failed (RuntimeError: Failed to apply the config: the controller"),
        ("failed", "the deploy failed: ValueError: replica refused it; see the server's log"),
        ("stuck", "raystream is not RUNNING 2 s after the deploy (now DEPLOYING; Inference: "),
    ],
)
def test_reconfigure_whose_deploy_fails_or_times_out_is_one_line(deploy, expected) -> None:
    result = run_cli(
        *("reconfigure", "max_batch_size=16", "--timeout", "2"),
        prelude=f"DEPLOY = {deploy!r}\n{FAKE_RAY}",
    )
    assert expected in _one_line(result)


# -- TLS against plaintext ----------------------------------------------------------------


@pytest.fixture
def grpc_servers(tmp_path):
    """A gRPC server with TLS (self-signed) and one without, on loopback: what the client
    meets before any method runs is the transport, the same as raystream's ingress."""
    key, cert = write_pem(tmp_path / "server", *issue_certificate("localhost", ca=True))
    tls = grpc.server(futures.ThreadPoolExecutor(2))
    tls_port = tls.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    )
    plain = grpc.server(futures.ThreadPoolExecutor(2))
    plain_port = plain.add_insecure_port("127.0.0.1:0")
    tls.start()
    plain.start()
    yield {"tls": f"127.0.0.1:{tls_port}", "plain": f"127.0.0.1:{plain_port}", "cert": cert}
    tls.stop(0)
    plain.stop(0)


def test_a_plaintext_client_of_a_tls_server_is_told_to_use_tls(grpc_servers, photo) -> None:
    for args in (["info"], ["classify", str(photo)]):
        line = _one_line(run_cli(*args, "--server", grpc_servers["tls"]))
        assert "expects TLS" in line and "--tls-ca" in line, line
        assert "make serve" not in line, line


def test_a_tls_client_of_a_plaintext_server_is_told_it_may_not_use_tls(grpc_servers) -> None:
    args = ("info", "--server", grpc_servers["plain"], "--tls-ca", str(grpc_servers["cert"]))
    line = _one_line(run_cli(*args))
    assert "may not use TLS" in line and "without --tls-ca" in line, line


def test_a_server_that_is_down_is_still_reported_as_down() -> None:
    line = _one_line(run_cli("info", "--server", "127.0.0.1:1", "--timeout", "5"))
    assert "is it running? Start it with `make serve`" in line, line


def test_a_server_command_without_the_servers_packages_says_what_to_install() -> None:
    """A client-only install (no yaml, no Ray): `raystream serve` is one line naming the
    server extra, not a traceback."""
    result = run_cli("serve", prelude="import sys\nsys.modules['yaml'] = None\n" + NO_RAY)
    line = _one_line(result)
    assert "needs the server's packages" in line and "raystream[server]" in line, line


def test_output_into_a_closed_pipe_ends_quietly(model_repository) -> None:
    """`raystream ... | head -1` on a long output: the reader goes away early, and the CLI
    stops without a traceback."""
    code = "import sys\nfrom clients.cli import main\nsys.exit(main(sys.argv[1:]))"
    args = ["export", "--model", "efficientnet-lite0", "--repository", str(model_repository)]
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args, "--if-missing"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    process.stdout.close()  # before the CLI has written anything
    stderr = process.communicate(timeout=60)[1].decode()
    assert process.returncode == 1, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def test_a_load_past_its_timeout_says_the_server_goes_on(listener) -> None:
    """`models load --timeout`: a load that outlasts it (here: a server that never
    answers) ends the CLI with one line, not a gRPC error; the server would go on."""
    address, _ = listener
    result = run_cli("models", "load", "m", "--timeout", "0.5", "--server", address, timeout=60)
    line = _one_line(result)
    assert "no answer within --timeout 0.5 s; the server goes on with load m" in line, line


def test_a_load_the_server_gives_up_on_says_why() -> None:
    """`models load` with no --timeout, against a server that answers the load with its own
    DEADLINE_EXCEEDED (its load timeout passed): one line with the server's
    reason, not a gRPC error."""
    reason = "['m/2'] not ready on every replica in the load timeout (600 s)"

    def give_up(request, context):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, reason)

    service = "inference.GRPCInferenceService"
    handler = grpc.method_handlers_generic_handler(
        service, {"RepositoryModelLoad": grpc.unary_unary_rpc_method_handler(give_up)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = run_cli("models", "load", "m", "--server", f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    line = _one_line(result)
    assert f"the server gave up on load m: {reason}" in line, line
