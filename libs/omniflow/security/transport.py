"""The process's security state: settings, TLS credentials, tokens, and the caller of an RPC.

Loaded once from the environment (:func:`state`); in-process tests and benchmarks that
run several identities in one process use :func:`configure` and pass ``security=`` to
servers and channels explicitly.
"""

from __future__ import annotations

import functools
import logging
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

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Security:
    """Settings plus what they load: credentials, the token table, our own identity."""

    settings: SecuritySettings
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = b""
    identity: Identity | None = None
    tokens: TokenTable | None = None
    _principals: dict[tuple[Any, ...], Principal] = field(default_factory=dict)

    @classmethod
    def load(cls, settings: SecuritySettings) -> Security:
        settings.check()
        sec = cls(settings)
        if settings.tls_on:
            sec.ca = Path(settings.tls_ca).read_bytes()
            sec.cert = Path(settings.tls_cert).read_bytes()
            sec.key = Path(settings.tls_key).read_bytes()
            sec.identity = identity_of_pem(sec.cert)
        if settings.tokens_file:
            sec.tokens = TokenTable.load(Path(settings.tokens_file))
        return sec

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
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

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
        # of a digest and a parse per call (tokens are loaded once, so nothing goes stale).
        key = (uri, token, tenant, roles)
        found = self._principals.get(key)
        if found is None:
            found = self._resolve(uri, token, tenant, roles)
            if len(self._principals) >= 4096:
                self._principals.clear()
            self._principals[key] = found
        return found

    def _resolve(self, uri: bytes, token: Any, tenant: Any, roles: Any) -> Principal:
        identity = _parse_uri(uri.decode())
        if identity is None:
            raise Unauthenticated(f"the peer certificate's identity {uri!r} is malformed")
        if token is not None:
            scheme, _, secret = str(token).partition(" ")
            grant = self.tokens.lookup(secret.strip()) if self.tokens else None
            if scheme.lower() != "bearer" or grant is None:
                raise Unauthenticated("the token is not valid (authorization: Bearer <token>)")
            return Principal(identity, grant.tenant, grant.roles)
        if identity.kind in FORWARDERS and tenant is not None:
            # A forwarded caller keeps its tenant and at most the user role: a forwarder
            # that wants admin rights must present an admin token.
            forwarded = frozenset(r for r in str(roles or "user").split(",") if r == "user")
            return Principal(identity, str(tenant), forwarded)
        # A service acting for itself: its kind (certificate) is what the policy checks.
        return Principal(identity, "", frozenset())


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
