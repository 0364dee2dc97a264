"""A certificate bundle: a local CA (kept if present), one certificate per service identity
and a token per caller grant, in one folder. ``omniflow certs`` (``omniflow.cli.certs``),
the local topology (``security.local``) and the tests make theirs with :func:`make_bundle`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from omniflow.errors import InvalidArgument
from omniflow.security.certs import IssuedCert, ensure_ca, issue
from omniflow.security.identity import ROLES, Identity, write_tokens

TOKENS_FILE = "tokens.json"


@dataclass(frozen=True, slots=True)
class Bundle:
    """What :func:`make_bundle` wrote."""

    folder: Path
    ca: Path
    certs: dict[str, IssuedCert]  # identity uri -> files
    tokens_file: Path | None
    tokens: dict[str, str]  # "tenant:roles" -> token

    def env_for(self, identity: Identity) -> dict[str, str]:
        """The security environment of a process holding ``identity``."""
        issued = self.certs[identity.uri]
        env = {
            "OMNIFLOW_TLS": "on",
            "OMNIFLOW_AUTH": "on",
            "OMNIFLOW_TLS_CA": str(self.ca),
            "OMNIFLOW_TLS_CERT": str(issued.cert),
            "OMNIFLOW_TLS_KEY": str(issued.key),
        }
        if self.tokens_file is not None:
            env["OMNIFLOW_TOKENS_FILE"] = str(self.tokens_file)
        return env


def parse_grant(text: str) -> tuple[str, list[str]]:
    """``tenant:role[,role]`` → (tenant, roles)."""
    tenant, _, roles_text = text.partition(":")
    roles = [r for r in roles_text.split(",") if r] or ["user"]
    if bad := [r for r in roles if r not in ROLES]:
        raise InvalidArgument(f"--token {text!r}: roles {bad}; accepted: {', '.join(ROLES)}")
    if not tenant and "admin" not in roles:
        raise InvalidArgument(f"--token {text!r}: a non-admin token needs a tenant (tenant:role)")
    return tenant, roles


def make_bundle(
    folder: Path,
    identities: list[Identity],
    grants: list[str] = (),  # type: ignore[assignment]
    dns: tuple[str, ...] = (),
) -> Bundle:
    """CA (kept if present), one certificate per identity, and a fresh token per grant."""
    ca, _ = ensure_ca(folder)
    issued = {i.uri: issue(folder, i, dns) for i in identities}
    tokens: dict[str, str] = {}
    tokens_file: Path | None = None
    if grants:
        entries: list[dict[str, object]] = []
        for grant in grants:
            tenant, roles = parse_grant(grant)
            token = secrets.token_urlsafe(32)
            tokens[grant] = token
            entries.append({"token": token, "tenant": tenant, "roles": roles})
        tokens_file = folder / TOKENS_FILE
        write_tokens(tokens_file, entries)
    return Bundle(folder, ca, issued, tokens_file, tokens)
