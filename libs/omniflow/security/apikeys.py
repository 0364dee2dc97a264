"""The gateway's API keys: each key names the tenant its requests act for.

``OMNIFLOW_GATEWAY_API_KEYS_FILE`` is a JSON file (0600)::

    {"keys": [{"key": "…", "tenant": "acme", "expires_at": "2026-12-31T23:59:59Z"},
              {"key": "…", "tenant": "", "admin": true}]}

``expires_at`` is optional (Unix seconds or ISO 8601); an expired key is refused. The
gateway reads the file again when it changes (``omniflow.security.reload``).

A request's tenant is forwarded to the coordinator, the router and the workers
(``x-omniflow-tenant``), so its runs, workflows and cached KV pages are that tenant's. An
admin key acts for the shared tenant ``""`` (what admins and services register is
visible to every tenant). Keys are looked up by their SHA-256, like tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from omniflow.errors import InvalidArgument
from omniflow.security.identity import DigestTable, Expiring, parse_expiry, token_digest
from omniflow.security.reload import Reloading

MIN_KEY_CHARS = 16


@dataclass(frozen=True, slots=True)
class KeyGrant(Expiring):
    tenant: str
    admin: bool = False
    expires_at: float = 0.0  # Unix seconds; 0: never


class ApiKeyTable(DigestTable[KeyGrant]):
    """API key → (tenant, admin)."""

    @classmethod
    def watch(cls, path: Path) -> Reloading[ApiKeyTable]:
        """The table of ``path``, loaded again when the file changes (a removed key stops
        working within ``reload.CHECK_S``)."""
        return Reloading(path, cls.load, lambda: cls({}))

    @classmethod
    def load(cls, path: Path) -> ApiKeyTable:
        where = f"OMNIFLOW_GATEWAY_API_KEYS_FILE {path}"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{where}: cannot read ({exc})") from exc
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise InvalidArgument(f'{where}: expected {{"keys": [{{"key", "tenant", "admin"}}]}}')
        grants: dict[str, KeyGrant] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise InvalidArgument(f"{where}: keys[{i}] must be an object")
            key, tenant = str(entry.get("key", "")), str(entry.get("tenant", ""))
            admin = entry.get("admin", False) is True
            if len(key) < MIN_KEY_CHARS:
                raise InvalidArgument(
                    f"{where}: keys[{i}].key must be at least {MIN_KEY_CHARS} characters"
                )
            if not tenant and not admin:
                raise InvalidArgument(f"{where}: keys[{i}].tenant is required (not an admin)")
            if "/" in tenant or len(tenant) > 128:
                raise InvalidArgument(f"{where}: keys[{i}].tenant: at most 128 chars, no '/'")
            expires = parse_expiry(entry.get("expires_at"), f"{where}: keys[{i}]")
            grants[token_digest(key)] = KeyGrant("" if admin else tenant, admin, expires)
        return cls(grants)


def write_keys(path: Path, entries: list[dict[str, object]]) -> None:
    """Write an API keys file (0600) for :meth:`ApiKeyTable.load`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"keys": entries}, out, indent=1)
