"""Security of the local topology (``omniflow up``): a CA and certificates in the run folder.

Opt-in for now (``OMNIFLOW_UP_TLS=on``): ``up`` calls :func:`prepare` with its plan, gives
each process :meth:`LocalPKI.env_for` in its spawn env (saved with it, so the supervisor's
restarts keep it), and every client of the topology started from this machine — the CLI,
a test — calls :func:`use_local_security` to present the run folder's client certificate
and its admin token. Services started directly (not through ``up``) are not affected.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from omniflow.cli.certs import Bundle, make_bundle
from omniflow.config import SecuritySettings
from omniflow.security.identity import Identity
from omniflow.security.transport import configure

PKI_DIR = "pki"
CLIENT_FILE = "client.json"
USER_GRANT, ADMIN_GRANT = "local:user", ":admin"

#: ``omniflow up``'s module of a process → the kind of its identity (any other: a worker).
KIND_OF_MODULE = {
    "kv_index": "kv-index",
    "kv_agent": "kv-agent",
    "router": "router",
    "coordinator": "coordinator",
    "gateway": "gateway",
}


def enabled() -> bool:
    """Whether ``omniflow up`` turns mutual TLS and auth on (``OMNIFLOW_UP_TLS=on``)."""
    return os.environ.get("OMNIFLOW_UP_TLS", "off").strip().lower() in ("on", "1", "true")


@dataclass(frozen=True, slots=True)
class LocalPKI:
    bundle: Bundle
    node: str

    def identity(self, name: str, module: str) -> Identity:
        return Identity(KIND_OF_MODULE.get(module, "worker"), self.node, name)

    def env_for(self, name: str, module: str) -> dict[str, str]:
        """The security env of process ``name`` (its instance id) running ``module``."""
        return self.bundle.env_for(self.identity(name, module))


def prepare(folder: Path, node: str, plan: list[tuple[str, str]]) -> LocalPKI:
    """Certificates for every (name, module) of ``plan``, a client identity, a user and an
    admin token, under ``folder/pki``; the client's settings in ``pki/client.json`` (0600)."""
    pki = folder / PKI_DIR
    ids = [Identity(KIND_OF_MODULE.get(m, "worker"), node, n) for n, m in plan]
    client = Identity("client", node, "cli")
    bundle = make_bundle(pki, [*ids, client], [USER_GRANT, ADMIN_GRANT])
    issued = bundle.certs[client.uri]
    record = {
        "OMNIFLOW_TLS": "on",
        "OMNIFLOW_TLS_CA": str(bundle.ca),
        "OMNIFLOW_TLS_CERT": str(issued.cert),
        "OMNIFLOW_TLS_KEY": str(issued.key),
        "OMNIFLOW_TOKEN": bundle.tokens[ADMIN_GRANT],
        "user_token": bundle.tokens[USER_GRANT],
    }
    path = pki / CLIENT_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out, indent=1)
    return LocalPKI(bundle, node)


def client_settings(folder: Path) -> SecuritySettings | None:
    """The client security of the topology in run folder ``folder``, or None (plaintext)."""
    path = folder / PKI_DIR / CLIENT_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return SecuritySettings(
        tls="on",
        tls_ca=record["OMNIFLOW_TLS_CA"],
        tls_cert=record["OMNIFLOW_TLS_CERT"],
        tls_key=record["OMNIFLOW_TLS_KEY"],
        token=record["OMNIFLOW_TOKEN"],
    )


def use_local_security(folder: Path) -> bool:
    """Make this process a client of the secured topology in ``folder`` (True), unless the
    environment configures security itself or the topology runs plaintext (False)."""
    if os.environ.get("OMNIFLOW_TLS"):
        return False
    settings = client_settings(folder)
    if settings is None:
        return False
    configure(settings)
    return True


def clear(folder: Path) -> None:
    """A plaintext ``up``: forget the client settings of an earlier secured run."""
    (folder / PKI_DIR / CLIENT_FILE).unlink(missing_ok=True)
