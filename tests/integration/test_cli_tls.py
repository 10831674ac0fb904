"""`raystream serve` with TLS on (security.tls_cert, tls_key): it probes readiness over TLS
with the server's own certificate as the root, presents a client certificate where the
server requires one (tls_client_ca) and it was given one, and says plainly when it cannot
probe. The probe against small gRPC health servers made here; then the real server."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2_grpc

from clients.serve_command import _Probe
from serve_app.config import AppConfig

from conftest import ROOT, free_port


def _health_server(cert: Path, key: Path, client_ca: Path | None = None):
    """A gRPC server with the health service (SERVING) over TLS, on loopback."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    credentials = grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca else None,
        require_client_auth=client_ca is not None,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


def _probe(security: dict, cert: Path | None = None, key: Path | None = None) -> _Probe:
    app = AppConfig.model_validate({"security": {k: str(v) for k, v in security.items()}})
    return _Probe(app, argparse.Namespace(probe_tls_cert=cert, probe_tls_key=key))


async def _serving(probe: _Probe, address: str, timeout: float = 20.0) -> bool:
    return await probe.wait_serving(address, timeout, lambda: True)


async def test_the_probe_trusts_a_self_signed_certificate(pki) -> None:
    server, address = _health_server(pki["self_cert"], pki["self_key"])
    probe = _probe({"tls_cert": pki["self_cert"], "tls_key": pki["self_key"]})
    assert probe.reason is None
    assert await _serving(probe, address)
    server.stop(0)


async def test_the_probe_dials_an_address_the_certificate_does_not_name(pki) -> None:
    """A certificate for raystream.example only, the probe dialing 127.0.0.1: it checks
    the name the certificate gives."""
    server, address = _health_server(pki["named_cert"], pki["named_key"])
    probe = _probe({"tls_cert": pki["named_cert"], "tls_key": pki["named_key"]})
    assert await _serving(probe, address)
    server.stop(0)


async def test_the_probe_presents_a_client_certificate_where_required(pki) -> None:
    server, address = _health_server(pki["server_cert"], pki["server_key"], pki["ca"])
    security = {"tls_cert": pki["server_cert"], "tls_key": pki["server_key"]}
    security["tls_client_ca"] = pki["ca"]
    without = _probe(security)
    assert "requires client certificates" in without.reason
    assert "--probe-tls-cert" in without.reason
    probe = _probe(security, pki["client_cert"], pki["client_key"])
    assert probe.reason is None
    assert await _serving(probe, address)
    server.stop(0)


async def test_the_probe_trusts_a_certificate_issued_by_a_ca_not_in_the_file(pki) -> None:
    server, address = _health_server(pki["server_cert"], pki["server_key"])
    probe = _probe({"tls_cert": pki["server_cert"], "tls_key": pki["server_key"]})
    assert await _serving(probe, address)
    server.stop(0)


async def test_a_certificate_the_probe_cannot_verify_is_said_at_once(pki) -> None:
    """An expired certificate: waiting would never make it verify, and the server would be
    stopped as not ready after --ready-timeout (900 s by default)."""
    server, address = _health_server(pki["expired_cert"], pki["expired_key"])
    probe = _probe({"tls_cert": pki["expired_cert"], "tls_key": pki["expired_key"]})
    started = time.monotonic()
    assert not await _serving(probe, address, timeout=60.0)
    assert time.monotonic() - started < 20
    assert "does not verify" in probe.reason, probe.reason
    server.stop(0)


@pytest.mark.slow
def test_raystream_serve_with_tls_says_when_it_is_ready(model_repository, pki, tmp_path) -> None:
    """The real server with TLS: the ready line (it never came before: readiness was not
    probed), a plaintext client told to use TLS, a TLS client classifying a real photo."""
    from skimage import data

    from conftest import encode

    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["applications"][0]["args"]["security"] = {
        "tls_cert": str(pki["self_cert"]),
        "tls_key": str(pki["self_key"]),
    }
    config_path = tmp_path / "serve_config.tls.yaml"
    config_path.write_text(yaml.safe_dump(config))
    photo = tmp_path / "chelsea.jpg"
    photo.write_bytes(encode(data.chelsea()))
    port = free_port()
    # the same helper as tests/integration/test_local_ray.py: output collected, own process group
    from test_local_ray import Server

    server = Server(
        *("--config", str(config_path), "--port", str(port), "--topology", "fused"),
        *("--model-repository", str(model_repository)),
    )
    try:
        ready = server.wait_for("raystream ready", timeout=400)
        assert f"gRPC (TLS) on 127.0.0.1:{port}" in ready, ready
        assert "model efficientnet-lite0/" in ready and "replicas running:" in ready, ready

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "clients.cli", *args],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )

        plaintext = cli("info", "--server", f"127.0.0.1:{port}")
        assert plaintext.returncode == 2
        assert "expects TLS" in plaintext.stderr and "--tls-ca" in plaintext.stderr
        assert "make serve" not in plaintext.stderr
        tls = cli(
            *("classify", str(photo), "--server", f"localhost:{port}"),
            *("--tls-ca", str(pki["self_cert"])),
        )
        assert tls.returncode == 0 and "cat" in tls.stdout, tls.stderr
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_raystream_serve_says_plainly_when_it_cannot_probe(model_repository, pki, tmp_path):
    """A server that requires client certificates, and none given to probe with: one line
    says readiness over gRPC is not probed and why; the ready line then rests on Serve's
    word that every replica runs."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["applications"][0]["args"]["security"] = {
        "tls_cert": str(pki["server_cert"]),
        "tls_key": str(pki["server_key"]),
        "tls_client_ca": str(pki["ca"]),
    }
    config_path = tmp_path / "serve_config.mtls.yaml"
    config_path.write_text(yaml.safe_dump(config))
    from test_local_ray import Server

    port = free_port()
    server = Server(
        *("--config", str(config_path), "--port", str(port), "--topology", "fused"),
        *("--model-repository", str(model_repository)),
    )
    try:
        line = server.wait_for("not probed", timeout=60)
        assert "requires client certificates" in line and "--probe-tls-cert" in line, line
        ready = server.wait_for("raystream ready", timeout=400)
        assert f"gRPC (TLS) on 127.0.0.1:{port}" in ready and "Ingress 1" in ready, ready
    finally:
        assert server.stop() == 0


def test_readiness_probe_is_not_left_to_time_out(pki) -> None:
    """The probe's answer arrives well before a --ready-timeout: a guard on wait_serving's
    result when the server is down (connection refused: keep waiting, alive() decides)."""
    probe = _probe({"tls_cert": pki["self_cert"], "tls_key": pki["self_key"]})
    checks = iter(range(3))
    alive = lambda: next(checks, None) is not None  # noqa: E731
    assert not asyncio.run(probe.wait_serving("127.0.0.1:1", 60.0, alive))
    assert probe.reason is None  # refused is not a certificate problem
