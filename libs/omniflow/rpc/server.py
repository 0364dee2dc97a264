"""Server bootstrap shared by every service.

Start: bind → serve health (NOT_SERVING) and reflection → ``app.start`` (dependencies
answer: Redis pinged, model loaded) → register in discovery → SERVING. Until SERVING,
every call of the app's own methods is refused with UNAVAILABLE (``ServingGate``): a
worker restarted on its old port, whose model is still loading, sends its callers to
another worker rather than answering as if it were ready.
Stop (SIGTERM/SIGINT): NOT_SERVING → deregister → ``server.stop(grace)`` → ``app.stop``
(close clients) → close discovery → flush traces.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from omniflow import __version__, telemetry
from omniflow.config import CommonSettings, settings_from_argv
from omniflow.discovery import Registry, ServiceInstance, make_registry
from omniflow.logsetup import setup_logging
from omniflow.rpc.client import MAX_MESSAGE_BYTES
from omniflow.rpc.interceptors import ServingGate, WrappingServer
from omniflow.security.transport import Security, state

log = logging.getLogger(__name__)

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


@dataclass(slots=True)
class Runtime:
    """What the bootstrap hands a service once its server is bound."""

    settings: CommonSettings
    address: str  # advertised host:port
    instance_id: str
    node: str
    registry: Registry
    #: Re-register with the app's current metadata (e.g. after a model was loaded).
    reregister: Callable[[], Awaitable[None]] | None = None


class ServiceApp(abc.ABC):
    """A service as the bootstrap sees it: servicers, dependencies, metadata."""

    #: Name in discovery ("router", "coordinator", "kv-index", "kv-agent", "worker").
    name: str = ""

    @abc.abstractmethod
    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        """Add the service's servicers; return their full proto service names."""

    async def start(self, runtime: Runtime) -> None:  # noqa: B027 - optional hook
        """Connect dependencies and warm up; raising fails the start."""

    def metadata(self) -> dict[str, str]:
        """Extra registration metadata (role, model, kv namespace...)."""
        return {}

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Close clients and release resources."""


def registry_from_settings(settings: CommonSettings) -> Registry:
    """The discovery backend the settings name."""
    if settings.discovery == "redis":
        return make_registry("redis", url=settings.redis_url)
    if settings.discovery == "consul":
        return make_registry(
            "consul",
            address=settings.consul_addr,
            token=settings.consul_token or None,
            check=settings.consul_check,
        )
    return make_registry("static", path=settings.static_file)


class ServiceHost:
    """Runs one ServiceApp: the part of the bootstrap that tests drive in-process."""

    def __init__(
        self,
        app: ServiceApp,
        settings: CommonSettings,
        registry: Registry | None = None,
        security: Security | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        #: TLS and the policy (the process's, from OMNIFLOW_TLS & co., unless given).
        self.security = security or state()
        self.registry = registry or registry_from_settings(settings)
        self.server = grpc.aio.server(
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        )
        self.health = HealthServicer()
        self.gate = ServingGate(app.name, open=False)  # opened once SERVING
        self.address = ""
        self.port = 0
        self.metrics_port: int | None = None
        self.instance: ServiceInstance | None = None
        self._instance_id = ""
        self._service_names: list[str] = []

    async def _set_health(self, status: int) -> None:
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def start(self) -> str:
        """Bind, start serving (NOT_SERVING), start the app, register, turn SERVING."""
        s = self.settings
        sec = self.security
        wrapping = WrappingServer(self.server, sec, self.gate)
        self._service_names = self.app.add_servicers(wrapping)  # type: ignore[arg-type]
        wrapping.finish()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if sec.reflection_on:
            reflection.enable_server_reflection(
                [*self._service_names, "grpc.health.v1.Health", reflection.SERVICE_NAME],
                self.server,
            )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if sec.tls_on:
                self.port = self.server.add_secure_port(
                    f"{s.host}:{s.port}", sec.server_credentials()
                )
            else:
                self.port = self.server.add_insecure_port(f"{s.host}:{s.port}")
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind {s.host}:{s.port} ({exc}); set OMNIFLOW_PORT") from exc
        await self.server.start()
        node = s.resolved_node()
        self.address = f"{s.resolved_advertise_host()}:{self.port}"
        instance_id = s.instance_id or f"{self.app.name}-{node}-{os.getpid()}"
        self.metrics_port = telemetry.start_metrics_server(s.metrics_port, s.host)
        self._instance_id = instance_id
        await self.app.start(
            Runtime(s, self.address, instance_id, node, self.registry, self.register)
        )
        await self.register()
        self.gate.open = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if s.ready_file:
            _write_ready(Path(s.ready_file), self.instance, self.metrics_port)
        log.info("%s SERVING at %s as %s", self.app.name, self.address, instance_id)
        return self.address

    async def register(self) -> None:
        """(Re-)register this instance with the app's current metadata."""
        s = self.settings
        meta = {"node": s.resolved_node(), "pid": str(os.getpid()), "version": __version__}
        if self.metrics_port is not None:
            meta["metrics"] = f"{s.resolved_advertise_host()}:{self.metrics_port}"
        meta.update(self.app.metadata())
        self.instance = ServiceInstance(self.app.name, self._instance_id, self.address, meta)
        await self.registry.register(self.instance, s.registration_ttl_s)

    async def stop(self) -> None:
        """NOT_SERVING → deregister → stop with grace → app.stop → close discovery."""
        self.gate.open = False  # new calls go elsewhere; those in flight finish
        await self.health.enter_graceful_shutdown()
        if self.instance is not None:
            try:
                await self.registry.deregister(self.instance.instance_id)
            except Exception as exc:  # keep shutting down: the TTL removes it anyway
                log.warning("deregister failed: %s", exc)
        await self.server.stop(self.settings.shutdown_grace_s)
        try:
            await self.app.stop()
        finally:
            await self.registry.close()
        log.info("%s stopped", self.app.name)


def _write_ready(path: Path, instance: ServiceInstance, metrics_port: int | None) -> None:
    record = {**instance.to_dict(), "pid": os.getpid(), "metrics_port": metrics_port}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # readers never see a half-written file


async def run_service(app: ServiceApp, settings: CommonSettings) -> int:
    """Serve ``app`` until SIGTERM or SIGINT; returns the process exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = ServiceHost(app, settings)
    try:
        await host.start()
    except Exception as exc:
        log.error("%s failed to start: %s", app.name, exc)
        await host.server.stop(None)
        await app.stop()
        await host.registry.close()
        return 1
    await stop.wait()
    log.info("%s shutting down", app.name)
    await host.stop()
    return 0


def serve_main(
    settings_cls: type[CommonSettings],
    build_app: Callable[[CommonSettings], ServiceApp],
    description: str,
    argv: list[str] | None = None,
) -> int:
    """The ``main`` of a service: settings, logging, tracing, then serve."""
    settings = settings_from_argv(settings_cls, argv, description)
    app = build_app(settings)
    setup_logging(app.name, settings.log_level)
    telemetry.setup_tracing(f"omniflow-{app.name}")
    try:
        return asyncio.run(run_service(app, settings))
    finally:
        telemetry.shutdown_tracing()
