"""Real processes on mutual TLS for the security tests: one CA's bundle, a Redis with a
password, and services each started as its own identity; all stopped at the end."""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509

from omniflow.config import SecuritySettings
from omniflow.localredis import RedisProcess, start_redis
from omniflow.security.bundle import Bundle, make_bundle
from omniflow.security.identity import Identity
from omniflow.security.transport import Security
from omniflow.testing.launch import ServiceProc, start_service, stop_all


def client_security(
    bundle: Bundle,
    caller: Identity,
    token: str = "",
    cert: Path | None = None,
    key: Path | None = None,
) -> Security:
    """Client-side security of ``caller`` (its certificate from ``bundle``, or ``cert`` and
    ``key``), presenting ``token``."""
    issued = bundle.certs[caller.uri]
    return Security.load(
        SecuritySettings(
            tls="on",
            tls_ca=str(bundle.ca),
            tls_cert=str(cert or issued.cert),
            tls_key=str(key or issued.key),
            token=token,
        )
    )


@dataclass
class PkiProcs:
    """Services started as the identities of ``services`` (name -> identity)."""

    folder: Path
    bundle: Bundle
    redis: RedisProcess
    services: Mapping[str, Identity]
    started: list[ServiceProc] = field(default_factory=list)

    def start(self, module: str, name: str, **env: str) -> ServiceProc:
        """``module`` as the service ``name``: its certificate, instance and node; no caller
        token (services present certificates, never a caller's token)."""
        ident = self.services[name]
        full = {
            **self.bundle.env_for(ident),
            "OMP_NUM_THREADS": "1",
            "OMNIFLOW_INSTANCE_ID": ident.instance,
            "OMNIFLOW_NODE_ID": ident.node,
            **env,
            "OMNIFLOW_TOKEN": "",
        }
        proc = start_service(module, name, tmp=self.folder, redis_url=self.redis.url, **full)
        self.started.append(proc)
        return proc

    def echo_control_plane(self, **coordinator_env: str) -> dict[str, ServiceProc]:
        """An echo worker ``echo-1``, the ``router`` and the ``coordinator``, each ready."""
        procs = {
            "echo-1": self.start(
                "omniflow_services.worker",
                "echo-1",
                OMNIFLOW_WORKER_ENGINE="echo",
                OMNIFLOW_WORKER_ROLE="echo",
            ).wait_ready(60)
        }
        procs["router"] = self.start(
            "omniflow_services.router", "router", OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.5"
        ).wait_ready(60)
        procs["coordinator"] = self.start(
            "omniflow_services.coordinator",
            "coordinator",
            OMNIFLOW_ROUTER_ADDR=procs["router"].address,
            **coordinator_env,
        ).wait_ready(60)
        return procs


@contextlib.contextmanager
def pki_procs(
    folder: Path,
    services: Mapping[str, Identity],
    callers: list[Identity],
    grants: list[str],
) -> Iterator[PkiProcs]:
    """A bundle (a certificate for every service and caller, a token per grant) and a
    Redis with a password; every service started through it is stopped on exit."""
    bundle = make_bundle(folder / "pki", [*services.values(), *callers], grants)
    redis = start_redis(dir=folder / "redis", password=secrets.token_hex(16))
    procs = PkiProcs(folder, bundle, redis, services)
    try:
        yield procs
    finally:
        stop_all(procs.started)
        redis.stop()


def served_certificate(address: str, ca: Path, cert: Path, key: Path) -> x509.Certificate:
    """The certificate a new TLS handshake with ``address`` presents (as the client of
    ``cert``/``key``, trusting ``ca``)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    ctx.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


async def code_of(call: Awaitable[object] | AsyncIterator[object]) -> grpc.StatusCode:
    """The status code a call ends with (OK when it succeeds), unary or streaming."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[union-attr]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
