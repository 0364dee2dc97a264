"""A local certificate authority: one CA, and a certificate per service identity.

The identity of a service is a URI SAN ``omniflow://<kind>/<node>/<instance>`` (see
:mod:`omniflow.security.identity`); the DNS/IP SANs (``localhost``, ``127.0.0.1``, the
host name, and any extra names such as compose service names) let clients verify the
server's host name as gRPC does by default. Keys are EC P-256 and written 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from omniflow.security.identity import Identity

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
#: The next CA while the CA itself is rotated (``omniflow.security.ca_rotation``).
CA_NEXT_CERT, CA_NEXT_KEY = "ca-next.pem", "ca-next.key"
VALID_DAYS = 365


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """Where one identity's certificate was written; its key is the file beside it."""

    identity: Identity
    cert: Path

    @property
    def key(self) -> Path:
        return key_of(self.cert)


def key_of(cert: Path) -> Path:
    """The key file of an identity certificate: ``<stem>.key`` next to its ``<stem>.pem``."""
    return cert.with_suffix(".key")


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_private(path, data)


def _write_private(path: Path, data: bytes) -> None:
    """``data`` into ``path``, 0600 from the start (never a moment where a key is
    world-readable) and whole: written beside it, then renamed over it, so that a service
    reloading its files (a rotation) never reads half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def _name(common: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "omniflow"),
            x509.NameAttribute(NameOID.COMMON_NAME, common[:64]),
        ]
    )


def _window() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)


def ensure_ca(folder: Path) -> tuple[Path, Path]:
    """The CA in ``folder`` (made once; an existing one is kept). Returns (cert, key)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    cert_path, key_path = folder / CA_CERT, folder / CA_KEY
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    make_ca(cert_path, key_path, "omniflow local CA")
    return cert_path, key_path


def make_ca(cert_path: Path, key_path: Path, common: str) -> None:
    """A new self-signed CA named ``common`` into ``cert_path`` / ``key_path``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common)
    start, end = _window()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))


def _sans(identity: Identity, dns: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    seen: set[str] = set()
    for host in ("localhost", socket.gethostname(), *dns):
        if host and host not in seen:
            seen.add(host)
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
    for ip in ("127.0.0.1", "::1"):
        if ip not in seen:
            names.append(x509.IPAddress(ipaddress.ip_address(ip)))
    return names


def issue(
    folder: Path,
    identity: Identity,
    dns: tuple[str, ...] = (),
    ca: tuple[Path, Path] | None = None,
) -> IssuedCert:
    """A certificate and key for ``identity`` signed by the CA in ``folder`` (or by ``ca``,
    its cert and key paths: the next CA while the CA itself is rotated).

    Written as ``<file_stem>.pem`` / ``<file_stem>.key``; an existing pair is replaced.
    Usable as a server and as a client certificate (mutual TLS).
    """
    ca_cert_path, ca_key_path = ca or ensure_ca(folder)
    # The first certificate of the file: ca.pem is a bundle while the CA is rotated.
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _window()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(identity.uri))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_sans(identity, dns)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    stem = identity.file_stem
    issued = IssuedCert(identity, folder / f"{stem}.pem")
    _write_key(issued.key, key)
    _write_private(issued.cert, cert.public_bytes(serialization.Encoding.PEM))
    return issued


def extra_names(cert_path: Path) -> tuple[str, ...]:
    """The DNS and IP names of a certificate beyond the ones :func:`issue` always adds
    (compose service names, a node's address): a renewed certificate keeps them."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    always = {"localhost", socket.gethostname(), "127.0.0.1", "::1"}
    names = [*sans.get_values_for_type(x509.DNSName)]
    names += [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    return tuple(n for n in names if n not in always)


def identity_certs(folder: Path) -> list[Path]:
    """The identity certificates of ``folder``: every ``.pem`` with its ``.key`` but a CA's."""
    return [
        p
        for p in sorted(folder.glob("*.pem"))
        if p.name not in (CA_CERT, CA_NEXT_CERT) and key_of(p).is_file()
    ]


def renew_all(folder: Path, ca: tuple[Path, Path] | None = None) -> list[IssuedCert]:
    """A new key and certificate, signed by the same CA (or by ``ca``: see ``issue``), for
    every identity certificate in ``folder`` (``omniflow certs rotate``); names and
    identities are kept."""
    from omniflow.security.transport import identity_of_pem

    renewed = []
    for cert_path in identity_certs(folder):
        identity = identity_of_pem(cert_path.read_bytes())
        issued = issue(folder, identity, extra_names(cert_path), ca)
        if issued.cert != cert_path:  # a file named otherwise: keep the name services read
            renamed = IssuedCert(identity, cert_path)
            issued.cert.replace(renamed.cert)
            issued.key.replace(renamed.key)
            issued = renamed
        renewed.append(issued)
    return renewed
