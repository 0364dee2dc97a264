"""Client channels: deadline on every call, tracing, bounded calls in flight, and
retries only for methods declared idempotent (through gRPC's own retry policy)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omniflow.rpc.interceptors import TracedChannel
from omniflow.security.transport import Security, state

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CLIENT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 1),
    # Reconnect soon to a peer that restarts (a supervised service comes back on its old
    # port within seconds); gRPC's default backoff grows to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def _retry_config(idempotent: Iterable[str]) -> str | None:
    """A service config retrying UNAVAILABLE once on the listed methods.

    Each entry is "package.Service/Method" or "package.Service" for all its methods.
    """
    names = []
    for entry in idempotent:
        service, _, method = entry.partition("/")
        names.append({"service": service, "method": method} if method else {"service": service})
    if not names:
        return None
    policy = {
        "maxAttempts": 2,
        "initialBackoff": "0.01s",
        "maxBackoff": "0.1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def open_channel(
    address: str,
    *,
    default_timeout_s: float = 10.0,
    max_in_flight: int | None = 256,
    idempotent: Iterable[str] = (),
    security: Security | None = None,
) -> TracedChannel:
    """A grpc.aio channel with deadlines, tracing and bounds (see TracedChannel).

    Mutual TLS and the process's token when the security settings say so (OMNIFLOW_TLS,
    OMNIFLOW_TOKEN); ``security`` overrides the process's (tests with several identities).
    """
    options: list[tuple[str, int | str]] = list(CLIENT_OPTIONS)
    config = _retry_config(idempotent)
    if config:
        options.append(("grpc.service_config", config))
    sec = security or state()
    channel = raw_channel(address, options, sec)
    return TracedChannel(channel, default_timeout_s, max_in_flight, sec.call_metadata())


def raw_channel(
    address: str,
    options: list[tuple[str, int | str]] | None = None,
    security: Security | None = None,
) -> grpc.aio.Channel:
    """A plain grpc.aio channel: TLS with this process's certificate when it is on."""
    sec = security or state()
    if sec.tls_on:
        return grpc.aio.secure_channel(address, sec.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


async def check_health(
    address: str, service: str = "", timeout_s: float = 1.0, security: Security | None = None
) -> str:
    """The health status name of ``service`` at ``address`` ("SERVING", "NOT_SERVING", ...),
    or "UNREACHABLE" when it does not answer in time."""
    async with raw_channel(address, security=security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_serving(
    address: str, timeout_s: float, service: str = "", security: Security | None = None
) -> None:
    """Wait until ``address`` reports SERVING; raises TimeoutError naming the last status."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    status = "UNREACHABLE"
    while loop.time() < end:
        status = await check_health(address, service, min(1.0, timeout_s), security)
        if status == "SERVING":
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING after {timeout_s:.1f}s (last status: {status})")
