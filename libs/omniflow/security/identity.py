"""Who is calling: a service identity from its certificate, a tenant from its token.

A service's certificate carries ``omniflow://<kind>/<node>/<instance>`` as a URI SAN;
``instance`` is the service's instance id (a worker's or agent's index owner id).
Callers (users, the CLI, tests) hold a certificate of kind ``client`` and present a
token (``authorization: Bearer <token>``) that the tokens file maps to a tenant and
roles. Services forwarding a caller's request (gateway, coordinator, router) say whose
it is with ``x-omniflow-tenant``; only those kinds are believed.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from omniflow.errors import InvalidArgument

URI_PREFIX = "omniflow://"

#: Kinds of service identity a certificate can name.
SERVICE_KINDS = ("worker", "kv-agent", "kv-index", "router", "coordinator", "gateway")
CLIENT_KIND = "client"
KINDS = (*SERVICE_KINDS, CLIENT_KIND)

#: Roles a token can grant.
ROLES = ("admin", "user", "worker", "agent")

#: Kinds that act on behalf of a caller and may name its tenant.
FORWARDERS = frozenset({"gateway", "coordinator", "router"})

TENANT_HEADER = "x-omniflow-tenant"
ROLES_HEADER = "x-omniflow-roles"


def forwarded(tenant: str) -> tuple[tuple[str, str], ...]:
    """Call metadata of a forwarding service (gateway, coordinator, router) acting for
    ``tenant``: the next service checks the call as that tenant's."""
    return ((TENANT_HEADER, tenant),)


_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class Identity:
    """A certificate's identity: kind of service, node, instance id."""

    kind: str
    node: str
    instance: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"identity kind {self.kind!r}; accepted: {', '.join(KINDS)}")
        for name in ("node", "instance"):
            value = getattr(self, name)
            if not value or "/" in value:
                raise InvalidArgument(f"identity {name} {value!r} must be non-empty, without '/'")

    @property
    def uri(self) -> str:
        return f"{URI_PREFIX}{self.kind}/{self.node}/{self.instance}"

    @property
    def file_stem(self) -> str:
        return _SAFE.sub("_", f"{self.kind}.{self.node}.{self.instance}")

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """``omniflow://kind/node/instance`` → Identity; InvalidArgument otherwise."""
        if not uri.startswith(URI_PREFIX):
            raise InvalidArgument(f"identity {uri!r} does not start with {URI_PREFIX}")
        parts = uri[len(URI_PREFIX) :].split("/")
        if len(parts) != 3:
            raise InvalidArgument(f"identity {uri!r} is not {URI_PREFIX}<kind>/<node>/<instance>")
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one RPC, as the policy sees it.

    ``identity`` is the peer certificate's (None when security is off); ``tenant`` and
    ``roles`` come from a token or, for a forwarding service, from its headers.
    ``enforced`` is False when security is off: every check then passes.
    """

    identity: Identity | None
    tenant: str = ""
    roles: frozenset[str] = field(default_factory=frozenset)
    enforced: bool = True

    @property
    def kind(self) -> str:
        return self.identity.kind if self.identity else ""

    @property
    def is_admin(self) -> bool:
        return not self.enforced or "admin" in self.roles

    @property
    def is_service(self) -> bool:
        return self.identity is not None and self.identity.kind in SERVICE_KINDS

    def describe(self) -> str:
        who = self.identity.uri if self.identity else "anonymous"
        if self.tenant or self.roles:
            who += f" (tenant {self.tenant!r}, roles {','.join(sorted(self.roles)) or '-'})"
        return who


#: The caller when security is off: everything is allowed, everything is tenant "".
UNCHECKED = Principal(None, "", frozenset(), enforced=False)


class Expiring:
    """A grant with ``expires_at`` (Unix seconds; 0: never)."""

    __slots__ = ()
    expires_at: float

    def expired(self, now: float | None = None) -> bool:
        return bool(self.expires_at) and (time.time() if now is None else now) >= self.expires_at


@dataclass(frozen=True, slots=True)
class TokenGrant(Expiring):
    tenant: str
    roles: frozenset[str]
    expires_at: float = 0.0  # Unix seconds; 0: never


def token_digest(token: str) -> str:
    # Looked up by digest: a dict probe on the secret itself would leak prefix timing.
    return hashlib.sha256(token.encode()).hexdigest()


def parse_expiry(value: object, where: str) -> float:
    """An entry's ``expires_at``: Unix seconds, or an ISO 8601 time with its zone
    (``2026-12-31T23:59:59Z``); absent or null: never (0.0)."""
    if value is None:
        return 0.0
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    if isinstance(value, str):
        try:
            when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            when = None
        if when is not None and when.tzinfo is not None:
            return when.timestamp()
    raise InvalidArgument(
        f"{where}.expires_at is {value!r}; accepted: Unix seconds (> 0) or an ISO 8601 "
        "time with its zone, e.g. 2026-12-31T23:59:59Z"
    )


G = TypeVar("G", bound=Expiring)


class DigestTable(Generic[G]):
    """Secrets (tokens, API keys) by their digest, each to its grant; an expired grant, or a
    secret not in the table, looks up as None."""

    def __init__(self, grants: dict[str, G]) -> None:
        self._by_digest = grants

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, secret: str) -> G | None:
        grant = self._by_digest.get(token_digest(secret))
        return None if grant is None or grant.expired() else grant


class TokenTable(DigestTable[TokenGrant]):
    """token → (tenant, roles, expiry), from a JSON file::

    {"tokens": [{"token": "…", "tenant": "acme", "roles": ["user"],
                 "expires_at": "2026-12-31T23:59:59Z"}, …]}

    ``expires_at`` is optional (Unix seconds or ISO 8601); an expired token is not valid.
    """

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"OMNIFLOW_TOKENS_FILE {path}: cannot read ({exc})") from exc
        grants: dict[str, TokenGrant] = {}
        for i, entry in enumerate(data.get("tokens", []) if isinstance(data, dict) else []):
            token, tenant = entry.get("token", ""), entry.get("tenant", "")
            roles = frozenset(entry.get("roles", ["user"]))
            if len(token) < 16:
                raise InvalidArgument(f"{path}: tokens[{i}].token must be at least 16 characters")
            if not tenant and "admin" not in roles:
                raise InvalidArgument(f"{path}: tokens[{i}].tenant is required (not an admin)")
            if bad := roles - set(ROLES):
                raise InvalidArgument(
                    f"{path}: tokens[{i}].roles {sorted(bad)}; accepted: {', '.join(ROLES)}"
                )
            expires = parse_expiry(entry.get("expires_at"), f"{path}: tokens[{i}]")
            grants[token_digest(token)] = TokenGrant(str(tenant), roles, expires)
        return cls(grants)


def write_tokens(path: Path, entries: list[dict[str, object]]) -> None:
    """Write a tokens file (0600) for :meth:`TokenTable.load`."""
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"tokens": entries}, out, indent=1)
