"""Test certificate authorities and the certificates they sign (the `cryptography` package)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


class TestCA:
    """A CA that lives for one test run: its certificate at `cert`, and `issue` to sign a
    server's or a client's certificate."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path, name: str) -> None:
        self._directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256()))
        self.cert = directory / f"{name}.pem"
        self.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, is_server: bool, host: str = "127.0.0.1") -> CertFiles:
        """A certificate for `name`, signed by this CA; a server's names `host` (an IP)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if is_server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if is_server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        files = CertFiles(cert=self._directory / f"{name}.pem",
                          key=self._directory / f"{name}-key.pem")
        files.cert.write_bytes(builder.sign(self._key, hashes.SHA256())
                               .public_bytes(serialization.Encoding.PEM))
        files.key.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        return files
