"""The process's security state: settings, TLS credentials, tokens, and the caller of an RPC.

Loaded once from the environment (:func:`state`); in-process tests and benchmarks that
run several identities in one process use :func:`configure` and pass ``security=`` to
servers and channels explicitly.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from omniflow.config import SecuritySettings, load_settings
from omniflow.errors import InvalidArgument, Unauthenticated
from omniflow.security.identity import (
    FORWARDERS,
    ROLES_HEADER,
    TENANT_HEADER,
    UNCHECKED,
    Identity,
    Principal,
    TokenTable,
)
from omniflow.security.reload import Reloading

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Security:
    """Settings plus what they load: credentials, the token table, our own identity."""

    settings: SecuritySettings
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = b""
    identity: Identity | None = None
    token_file: Reloading[TokenTable] | None = None
    _principals: dict[tuple[Any, ...], tuple[Principal, float]] = field(default_factory=dict)
    _table: TokenTable | None = None  # the table the cached principals were resolved with
    _files: tuple[int, int, int] | None = None  # signature of the TLS files read last
    _generation: int = 0  # bumped by every reload of the TLS files

    @classmethod
    def load(cls, settings: SecuritySettings) -> Security:
        settings.check()
        sec = cls(settings)
        if settings.tls_on:
            sec._files = _tls_signature(settings)
            sec.ca, sec.cert, sec.key = _read_pair(settings)
            sec.identity = identity_of_pem(sec.cert)
        if settings.tokens_file:
            # Read again when it changes: a removed token stops working within CHECK_S.
            sec.token_file = Reloading(
                Path(settings.tokens_file), TokenTable.load, lambda: TokenTable({})
            )
        return sec

    @property
    def tokens(self) -> TokenTable | None:
        return self.token_file.current() if self.token_file is not None else None

    @property
    def tls_on(self) -> bool:
        return self.settings.tls_on

    @property
    def auth_on(self) -> bool:
        return self.settings.auth_on

    @property
    def reflection_on(self) -> bool:
        mode = self.settings.reflection
        return mode == "on" or (mode == "dev" and not self.tls_on)

    # -- transport
    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS whose certificate is read again once ``omniflow certs rotate`` (or
        anything) replaces the files: gRPC asks for the configuration before each new
        handshake; connections already open keep theirs, so no request is lost."""
        served = [self._generation]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            self.reload_tls()
            if served[0] == self._generation:
                return None  # keep the current one
            served[0] = self._generation
            return grpc.ssl_server_certificate_configuration(
                [(self.key, self.cert)], root_certificates=self.ca
            )

        initial = grpc.ssl_server_certificate_configuration(
            [(self.key, self.cert)], root_certificates=self.ca
        )
        return grpc.dynamic_ssl_server_credentials(
            initial, fetch, require_client_authentication=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        self.reload_tls()  # a new channel presents a rotated certificate
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def reload_tls(self) -> bool:
        """Take the TLS files again if they changed and load as a matching pair of the same
        identity (True then). A rotation caught half-written is tried at the next call."""
        if not self.tls_on:
            return False
        seen = _tls_signature(self.settings)
        if seen is None or seen == self._files:
            return False
        try:
            ca, cert, key = _read_tls(self.settings)
            identity = identity_of_pem(cert)
            _check_pair(cert, key)
        except (OSError, ValueError, InvalidArgument) as exc:
            log.warning("TLS files changed but do not load yet (%s); keeping the current", exc)
            return False
        self._files = seen
        if self.identity is not None and identity != self.identity:
            log.error("the new certificate names %s, not %s; keeping the current",
                      identity.uri, self.identity.uri)  # fmt: skip
            return False
        self.ca, self.cert, self.key = ca, cert, key
        self._generation += 1
        log.info("TLS certificate reloaded from %s", self.settings.tls_cert)
        return True

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata every outgoing call carries: the process's token, if it has one."""
        token = self.settings.token
        return (("authorization", f"Bearer {token}"),) if token else ()

    # -- the caller of an RPC
    def principal(self, context: grpc.aio.ServicerContext, metadata: Any = None) -> Principal:
        """Who calls: the peer certificate's identity, plus a tenant from a token or,
        from a forwarding service, from its headers. Raises Unauthenticated."""
        if not self.auth_on:
            return UNCHECKED
        uri = _peer_uri(context)
        if uri is None:
            raise Unauthenticated("no omniflow identity in the peer certificate")
        token = tenant = roles = None
        for key, value in metadata if metadata is not None else context.invocation_metadata() or ():
            if key == "authorization":
                token = value
            elif key == TENANT_HEADER:
                tenant = value
            elif key == ROLES_HEADER:
                roles = value
        # The same peer with the same headers is the same principal: one dict probe instead
        # of a digest and a parse per call. The cache is dropped when the tokens file is
        # reloaded, and an entry lapses with its token's expiry.
        table = self.tokens
        if table is not self._table:
            self._principals.clear()
            self._table = table
        key = (uri, token, tenant, roles)
        found = self._principals.get(key)
        if found is None or (found[1] and time.time() >= found[1]):
            found = self._resolve(uri, token, tenant, roles, table)
            if len(self._principals) >= 4096:
                self._principals.clear()
            self._principals[key] = found
        return found[0]

    def _resolve(
        self, uri: bytes, token: Any, tenant: Any, roles: Any, table: TokenTable | None
    ) -> tuple[Principal, float]:
        identity = _parse_uri(uri.decode())
        if identity is None:
            raise Unauthenticated(f"the peer certificate's identity {uri!r} is malformed")
        if token is not None:
            scheme, _, secret = str(token).partition(" ")
            grant = table.lookup(secret.strip()) if table else None
            if scheme.lower() != "bearer" or grant is None:
                raise Unauthenticated(
                    "the token is not valid or has expired (authorization: Bearer <token>)"
                )
            return Principal(identity, grant.tenant, grant.roles), grant.expires_at
        if identity.kind in FORWARDERS and tenant is not None:
            # A forwarded caller keeps its tenant and at most the user role: a forwarder
            # that wants admin rights must present an admin token.
            forwarded = frozenset(r for r in str(roles or "user").split(",") if r == "user")
            return Principal(identity, str(tenant), forwarded), 0.0
        # A service acting for itself: its kind (certificate) is what the policy checks.
        return Principal(identity, "", frozenset()), 0.0


def _read_tls(settings: SecuritySettings) -> tuple[bytes, bytes, bytes]:
    return (
        Path(settings.tls_ca).read_bytes(),
        Path(settings.tls_cert).read_bytes(),
        Path(settings.tls_key).read_bytes(),
    )


def _read_pair(settings: SecuritySettings, wait_s: float = 2.0) -> tuple[bytes, bytes, bytes]:
    """The TLS files as a matching pair: a process started while ``omniflow certs rotate``
    is between renaming the new key and the new certificate reads them again (briefly),
    instead of handing gRPC a certificate with another's key."""
    deadline = time.monotonic() + wait_s
    while True:
        ca, cert, key = _read_tls(settings)
        try:
            _check_pair(cert, key)
            return ca, cert, key
        except ValueError:
            if time.monotonic() >= deadline:
                raise InvalidArgument(
                    f"TLS key {settings.tls_key} does not match certificate {settings.tls_cert}"
                ) from None
            time.sleep(0.02)


def _tls_signature(settings: SecuritySettings) -> tuple[int, int, int] | None:
    """When the CA, certificate or key file last changed (their latest mtime and inodes)."""
    try:
        stats = [os.stat(p) for p in (settings.tls_ca, settings.tls_cert, settings.tls_key)]
    except OSError:
        return None
    return (
        max(s.st_mtime_ns for s in stats),
        hash(tuple(s.st_ino for s in stats)),
        sum(s.st_size for s in stats),
    )


def _check_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """ValueError unless ``key_pem`` is the private key of ``cert_pem`` (a rotation caught
    between writing the key and the certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    if cert.public_key().public_bytes(enc, fmt) != key.public_key().public_bytes(enc, fmt):
        raise ValueError("the key does not match the certificate")


def identity_of_pem(pem: bytes) -> Identity:
    """The omniflow identity (URI SAN) of a PEM certificate."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise InvalidArgument("the certificate has no subjectAltName") from None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith("omniflow://"):
            return Identity.parse(uri)
    raise InvalidArgument("the certificate names no omniflow:// identity")


@functools.lru_cache(maxsize=4096)
def _parse_uri(uri: str) -> Identity | None:
    try:
        return Identity.parse(uri)
    except InvalidArgument:
        return None


def _peer_uri(context: Any) -> bytes | None:
    # peer_identities() (the SANs of a TLS peer) costs ~1 us; auth_context() builds a dict
    # with the whole PEM, ~20 us per call.
    for raw in context.peer_identities() or ():
        if raw.startswith(b"omniflow://"):
            return bytes(raw)
    return None


_STATE: Security | None = None


def state() -> Security:
    """The process's security (from the environment on first use)."""
    global _STATE
    if _STATE is None:
        _STATE = Security.load(load_settings(SecuritySettings))
    return _STATE


def configure(settings: SecuritySettings | None) -> Security:
    """Replace the process's security (None: read the environment again)."""
    global _STATE
    _STATE = None if settings is None else Security.load(settings)
    return state()
