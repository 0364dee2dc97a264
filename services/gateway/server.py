"""The gateway process: uvicorn serving the app, registered in discovery like every service.

Start: bind the HTTP port → serve (``/health`` answers 503) → register (kind ``gateway``,
its URL in the metadata) → ``/health`` 200 → ready file.
Stop (SIGTERM/SIGINT): ``/health`` 503 → deregister → uvicorn stops with grace (requests
in flight finish) → close the gRPC channels and discovery → flush traces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from omniflow import __version__, telemetry
from omniflow.config import settings_from_argv
from omniflow.discovery import ServiceInstance
from omniflow.logsetup import setup_logging
from omniflow.rpc.server import registry_from_settings
from omniflow_services.gateway.app import build_app
from omniflow_services.gateway.backends import Backends
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.gateway.core import GatewayCore

log = logging.getLogger(__name__)

SERVICE = "gateway"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the process's shutdown order is ours."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it Nagle holds a response's second write for a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(
            f"cannot bind {host}:{port} ({exc}); set OMNIFLOW_GATEWAY_PORT (0 picks a free one)"
        ) from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(settings: GatewaySettings) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registry = registry_from_settings(settings)
    backends = Backends(settings, registry)
    backends.start()  # the pick's load and health polling
    serving = [False]
    app = build_app(settings, GatewayCore(settings, backends), lambda: serving[0])
    try:
        sock = _bind(settings.host, settings.http_port)
    except RuntimeError as exc:
        log.error("gateway failed to start: %s", exc)
        await backends.close()
        await registry.close()
        return 1
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        http=_http_protocol(settings),
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) or None,
        timeout_keep_alive=max(int(settings.idle_timeout_s), 1),
        limit_concurrency=settings.max_connections,
        h11_max_incomplete_event_size=settings.max_header_bytes,  # the h11 fallback's bound
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn has no started event
        await asyncio.sleep(0.01)
    if task.done():
        log.error("gateway failed to start: %s", task.exception())
        await backends.close()
        await registry.close()
        return 1
    node = settings.resolved_node()
    host = settings.resolved_advertise_host()
    address = f"{host}:{port}"
    url = f"http://{address}"
    instance_id = settings.instance_id or f"{SERVICE}-{node}-{os.getpid()}"
    meta = {"node": node, "pid": str(os.getpid()), "version": __version__, "url": url}
    meta["protocol"] = "http"
    meta["metrics"] = f"{address}/metrics"
    instance = ServiceInstance(SERVICE, instance_id, address, meta)
    try:
        await registry.register(instance, settings.registration_ttl_s)
    except Exception as exc:
        log.error("gateway failed to register: %s", exc)
        server.should_exit = True
        await task
        await backends.close()
        await registry.close()
        return 1
    serving[0] = True
    if settings.ready_file:
        _write_ready(Path(settings.ready_file), instance)
    log.info("gateway SERVING the OpenAI API at %s as %s", url, instance_id)
    await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
    log.info("gateway shutting down")
    serving[0] = False
    try:
        await registry.deregister(instance_id)
    except Exception as exc:  # keep shutting down: the TTL removes it anyway
        log.warning("deregister failed: %s", exc)
    server.should_exit = True
    await task
    await backends.close()
    await registry.close()
    log.info("gateway stopped")
    return 0


def _http_protocol(settings: GatewaySettings) -> Any:
    """uvicorn's httptools protocol with the header, header-time and body-time bounds
    (``http_bounds``); without httptools, h11 (its event size bounds the headers)."""
    try:
        from omniflow_services.gateway.http_bounds import HttpLimits, bounded_protocol
    except ImportError:  # no httptools: uvicorn's pure-Python h11
        log.warning("httptools is not installed: header and body read timeouts are off")
        return "h11"
    limits = HttpLimits(
        settings.max_header_bytes, settings.header_timeout_s, settings.body_timeout_s
    )
    return bounded_protocol(limits)


def _write_ready(path: Path, instance: ServiceInstance) -> None:
    record = {**instance.to_dict(), "pid": os.getpid(), "url": instance.metadata["url"]}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # readers never see a half-written file


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_argv(GatewaySettings, argv, "Omni-Flow OpenAI-compatible gateway")
    setup_logging(SERVICE, settings.log_level)
    telemetry.setup_tracing(f"omniflow-{SERVICE}")
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(serve(settings))
    finally:
        telemetry.shutdown_tracing()


def _loop_factory() -> Any:
    """uvloop's event loop when it is installed (as vLLM's server runs: its transports
    write and wake in C, a fraction of the default loop's cost per HTTP request and SSE
    chunk); else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: the gateway runs on asyncio's default loop")
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
