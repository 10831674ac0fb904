"""Test certificates: a CA, servers and clients, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

LOCAL = ("localhost", "127.0.0.1")


def issue_certificate(
    name: str, issuer_key=None, issuer_name=None, *, ca: bool, san=LOCAL, days: float = 1
):
    """A key and a certificate for `name`, signed by `issuer_key` (self-signed without one);
    `san`: the names and addresses it is for; `days`: valid until then (< 0: expired)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=2))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        names = [
            x509.DNSName(n) if n[0].isalpha() else x509.IPAddress(ipaddress.ip_address(n))
            for n in san
        ]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(issuer_key or key, hashes.SHA256())


def write_pem(path: Path, key, cert) -> tuple[Path, Path]:
    """`key` and `cert` as PEM files beside `path`: (path.key, path.pem)."""
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def make_pki(root: Path) -> dict[str, Path]:
    """The tests' certificates as PEM files under `root`: a CA (`ca`, `ca_key`); a server for
    localhost (`server_*`) and a client (`client_*`) it issued; and self-signed ones: for
    localhost (`self_*`), for raystream.example only (`named_*`), and expired (`expired_*`)."""
    ca_key, ca_cert = issue_certificate("raystream test CA", ca=True, san=())
    files: dict[str, Path] = {}
    files["ca_key"], files["ca"] = write_pem(root / "ca", ca_key, ca_cert)
    made = {
        "server": issue_certificate("localhost", ca_key, ca_cert.subject, ca=False),
        "client": issue_certificate("client", ca_key, ca_cert.subject, ca=False, san=("client",)),
        "self": issue_certificate("localhost", ca=True),
        "named": issue_certificate("raystream.example", ca=True, san=("raystream.example",)),
        "expired": issue_certificate("localhost", ca=True, days=-1),
    }
    for name, (key, cert) in made.items():
        files[f"{name}_key"], files[f"{name}_cert"] = write_pem(root / name, key, cert)
    return files
