"""A throwaway certificate authority and a server certificate for loopback.

The EKS stand-in must be reached over HTTPS with a CA that clients trust
explicitly (as they trust an EKS cluster's ``certificateAuthority.data``), so
each server start mints a fresh CA and a certificate for ``127.0.0.1`` and
``localhost`` signed by it. Nothing is written anywhere but a private
temporary directory that lives only while the SSL context is built.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class ServerCertificate:
    """PEM material for one server start: the CA certificate and the server's chain and key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @property
    def ca_data(self) -> str:
        """The CA as EKS reports it in ``DescribeCluster``: base64 of the PEM."""
        return base64.b64encode(self.ca_pem).decode("ascii")

    def server_context(self) -> ssl.SSLContext:
        """An SSL context that serves this certificate (TLS 1.2 or later)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # load_cert_chain reads only from files; keep them private and short-lived.
        with tempfile.TemporaryDirectory(prefix="sdcguard-eks-tls-") as tmp:
            cert_file = Path(tmp) / "server.pem"
            key_file = Path(tmp) / "server.key"
            cert_file.write_bytes(self.cert_pem)
            key_file.touch(mode=0o600)
            key_file.write_bytes(self.key_pem)
            context.load_cert_chain(cert_file, key_file)
        return context


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sdcguard local stand-in"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def issue_server_certificate(hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> ServerCertificate:
    """Mint a new CA and a server certificate for ``hosts`` (IP addresses or DNS names), valid one day.

    EC P-256 keys keep generation in the milliseconds, so every server start
    can afford its own CA.
    """
    now = dt.datetime.now(dt.UTC)
    # Backdate a little: clients with a slightly slow clock must not see "not yet valid".
    not_before = now - dt.timedelta(minutes=5)
    not_after = now + dt.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("sdcguard local EKS CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    return ServerCertificate(
        ca_pem=ca_cert.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM)
        + ca_cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
