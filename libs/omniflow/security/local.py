"""Security of the local topology (``omniflow up``): a CA and certificates in the run folder.

On by default; plaintext only for development, when asked for (``omniflow up --insecure``
or ``OMNIFLOW_UP_TLS=off``). ``up`` calls :func:`prepare` with its plan, gives
each process :meth:`LocalPKI.env_for` in its spawn env (saved with it, so the supervisor's
restarts keep it), and every client of the topology started from this machine — the CLI,
a test — calls :func:`use_local_security` to present the run folder's client certificate
and its admin token. Services started directly (not through ``up``) are not affected.

The gateway's HTTP side takes API keys (``pki/gateway-keys.json``): ``gateway_api_key`` in
``pki/client.json`` acts for the tenant ``local``, ``gateway_admin_key`` for the shared one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from omniflow.config import SecuritySettings, SettingsError, local_settings
from omniflow.errors import InvalidArgument
from omniflow.security.apikeys import write_keys
from omniflow.security.bundle import Bundle, make_bundle
from omniflow.security.identity import Identity
from omniflow.security.transport import configure

PKI_DIR = "pki"
CLIENT_FILE = "client.json"
GATEWAY_KEYS_FILE = "gateway-keys.json"
LOCAL_TENANT = "local"
USER_GRANT, ADMIN_GRANT = "local:user", ":admin"

#: ``omniflow up``'s module of a process → the kind of its identity (any other: a worker).
KIND_OF_MODULE = {
    "kv_index": "kv-index",
    "kv_agent": "kv-agent",
    "router": "router",
    "coordinator": "coordinator",
    "gateway": "gateway",
}


UP_TLS_VAR = "OMNIFLOW_UP_TLS"


def enabled() -> bool:
    """Whether ``omniflow up`` turns mutual TLS and auth on: yes unless ``OMNIFLOW_UP_TLS``
    is ``off`` (development; ``omniflow up --insecure`` sets it)."""
    try:
        return local_settings().up_tls
    except SettingsError as exc:
        raise InvalidArgument(str(exc)) from None


@dataclass(frozen=True, slots=True)
class LocalPKI:
    bundle: Bundle
    node: str
    gateway_keys: Path

    def identity(self, name: str, module: str) -> Identity:
        return Identity(KIND_OF_MODULE.get(module, "worker"), self.node, name)

    def env_for(self, name: str, module: str) -> dict[str, str]:
        """The security env of process ``name`` (its instance id) running ``module``."""
        env = self.bundle.env_for(self.identity(name, module))
        if module == "gateway" and not local_settings().gateway_api_keys_file:
            env["OMNIFLOW_GATEWAY_API_KEYS_FILE"] = str(self.gateway_keys)  # else: the user's
        return env


def prepare(folder: Path, node: str, plan: list[tuple[str, str]]) -> LocalPKI:
    """Certificates for every (name, module) of ``plan``, a client identity, a user and an
    admin token, under ``folder/pki``; the client's settings in ``pki/client.json`` (0600)."""
    pki = folder / PKI_DIR
    ids = [Identity(KIND_OF_MODULE.get(m, "worker"), node, n) for n, m in plan]
    client = Identity("client", node, "cli")
    bundle = make_bundle(pki, [*ids, client], [USER_GRANT, ADMIN_GRANT])
    issued = bundle.certs[client.uri]
    user_key, admin_key = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    gateway_keys = pki / GATEWAY_KEYS_FILE
    write_keys(
        gateway_keys,
        [
            {"key": user_key, "tenant": LOCAL_TENANT},
            {"key": admin_key, "tenant": "", "admin": True},
        ],
    )
    record = {
        "OMNIFLOW_TLS": "on",
        "OMNIFLOW_TLS_CA": str(bundle.ca),
        "OMNIFLOW_TLS_CERT": str(issued.cert),
        "OMNIFLOW_TLS_KEY": str(issued.key),
        "OMNIFLOW_TOKEN": bundle.tokens[ADMIN_GRANT],
        "user_token": bundle.tokens[USER_GRANT],
        "gateway_api_key": user_key,
        "gateway_admin_key": admin_key,
    }
    path = pki / CLIENT_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out, indent=1)
    return LocalPKI(bundle, node, gateway_keys)


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


STATE_FILE = "state.json"  # omniflow.cli.local's record of the processes it started


def use_local_security(folder: Path, *, starting: bool = False) -> bool:
    """Make this process a client of the secured topology in ``folder`` (True), unless the
    environment configures security itself, the topology runs plaintext, or no topology
    is recorded there (False). ``pki/client.json`` outlives a topology whose processes
    were killed: without ``state.json`` beside it (``up`` writes it, ``down`` removes
    both) it is another run's, and a client that took it would fail every handshake with
    whatever plaintext topology it talks to now. ``starting``: ``up`` itself, before its
    first process is recorded."""
    if local_settings().tls:
        return False
    if not starting and not (folder / STATE_FILE).is_file():
        return False
    settings = client_settings(folder)
    if settings is None:
        return False
    configure(settings)
    return True


@contextlib.contextmanager
def local_client(folder: Path) -> Iterator[bool]:
    """:func:`use_local_security` for a block; the process's own settings come back after
    (a test that drives an ``omniflow up`` topology, then plaintext services of its own)."""
    used = use_local_security(folder)
    try:
        yield used
    finally:
        if used:
            configure(None)


def client_record(folder: Path) -> dict[str, str]:
    """``pki/client.json`` of a secured topology (its tokens and gateway keys), or {}."""
    path = folder / PKI_DIR / CLIENT_FILE
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def clear(folder: Path) -> None:
    """Forget the client settings of a secured run: a plaintext ``up``, and ``down``."""
    (folder / PKI_DIR / CLIENT_FILE).unlink(missing_ok=True)
