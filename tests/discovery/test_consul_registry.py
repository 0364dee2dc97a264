"""Consul discovery backend against the Consul stand-in (see consul_standin.py).

The stand-in serves real HTTP on a real socket; the backend talks to it through
py-consul exactly as it would to a Consul agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from consul_standin import ConsulStandIn
from discovery_helpers import EVENTUALLY_S, ids, next_until
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omniflow.discovery import DiscoveryError, ServiceInstance, make_registry
from omniflow.discovery.consul_backend import ConsulRegistry
from omniflow.errors import InvalidArgument

TOKEN = "s3cret-token"


@pytest.fixture
def standin() -> Iterator[tuple[ConsulStandIn, str]]:
    agent = ConsulStandIn(acl_token=TOKEN)
    address = agent.start()
    yield agent, address
    agent.stop()


@pytest.fixture
async def registry(standin: tuple[ConsulStandIn, str]) -> AsyncIterator[ConsulRegistry]:
    reg = ConsulRegistry(standin[1], token=TOKEN, timeout_s=5, watch_wait_s=2)
    yield reg
    await reg.close()


def inst(instance_id: str, port: int = 50051, **meta: str) -> ServiceInstance:
    return ServiceInstance("worker", instance_id, f"127.0.0.1:{port}", dict(meta))


async def test_register_list_watch_deregister(
    standin: tuple[ConsulStandIn, str], registry: ConsulRegistry
) -> None:
    agent, _ = standin
    w0 = inst("w-0", role="llm", kv_namespace="abc123")
    async with contextlib.aclosing(registry.watch("worker")) as watch:
        assert await anext(watch) == []
        await registry.register(w0, ttl_s=5)
        assert await registry.list("worker") == [w0]
        assert await next_until(watch, lambda listing: listing != []) == [w0]

        # What the agent received: Meta, address, and a passing TTL check.
        svc = agent.services["w-0"]
        assert (svc.name, svc.address, svc.port) == ("worker", "127.0.0.1", 50051)
        assert svc.meta == {"role": "llm", "kv_namespace": "abc123"}
        [check] = [agent.checks[c] for c in svc.checks]
        assert check.definition["TTL"] == "5000ms"
        assert check.definition["DeregisterCriticalServiceAfter"] == "60000ms"
        assert check.status == "passing"

        await registry.register(inst("w-1", 50052), ttl_s=5)
        assert ids(await next_until(watch, lambda listing: len(listing) == 2)) == ["w-0", "w-1"]
        await registry.deregister("w-0")
        assert ids(await registry.list("worker")) == ["w-1"]
        assert ids(await next_until(watch, lambda listing: len(listing) == 1)) == ["w-1"]
    await registry.deregister("w-0")  # unknown now: ignored
    assert await registry.list("router") == []
    # The watch used blocking queries rather than polling.
    assert any(
        "/v1/health/service/worker?" in path and "index=" in path and "wait=" in path
        for method, path in agent.requests
    )


async def test_ttl_check_lapses_when_refresher_stops(
    standin: tuple[ConsulStandIn, str], registry: ConsulRegistry
) -> None:
    agent, address = standin
    dying = ConsulRegistry(address, token=TOKEN)
    await dying.register(inst("w-dead"), ttl_s=0.6)
    await registry.register(inst("w-live", 50052), ttl_s=0.6)
    async with contextlib.aclosing(registry.watch("worker")) as watch:
        assert ids(await anext(watch)) == ["w-dead", "w-live"]
        await dying.close()  # like SIGKILL: no deregister, no more passes
        assert ids(await next_until(watch, lambda listing: len(listing) == 1)) == ["w-live"]
    # Still registered with the agent, only failing its check.
    assert agent.checks["omniflow:w-dead"].status == "critical"
    assert agent.checks["omniflow:w-live"].status == "passing"


async def test_refresher_registers_again_when_agent_forgets(
    standin: tuple[ConsulStandIn, str], registry: ConsulRegistry
) -> None:
    agent, _ = standin
    await registry.register(inst("w-0"), ttl_s=0.6)
    with agent._cond:  # as if the agent restarted and lost its local services
        agent._remove_service("w-0")
    async with contextlib.aclosing(registry.watch("worker")) as watch:
        await next_until(watch, lambda listing: ids(listing) == ["w-0"])


async def test_token_rejection(standin: tuple[ConsulStandIn, str]) -> None:
    _, address = standin
    async with ConsulRegistry(address, token="wrong") as reg:
        with pytest.raises(DiscoveryError, match="ACL token rejected"):
            await reg.register(inst("w-0"), ttl_s=5)
        with pytest.raises(DiscoveryError, match="ACL token rejected"):
            await reg.list("worker")
        with pytest.raises(DiscoveryError, match="ACL token rejected"):
            await anext(reg.watch("worker"))


async def test_token_from_environment(
    standin: tuple[ConsulStandIn, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, address = standin
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", TOKEN)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", address)
    async with make_registry("consul") as reg:
        await reg.register(inst("w-0"), ttl_s=5)
        assert ids(await reg.list("worker")) == ["w-0"]
        await reg.deregister("w-0")


async def test_grpc_health_check(standin: tuple[ConsulStandIn, str]) -> None:
    agent, address = standin
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        reg = ConsulRegistry(
            address, token=TOKEN, check="grpc", grpc_interval_s=0.1, watch_wait_s=2
        )
        async with reg:
            await reg.register(inst("w-grpc", port), ttl_s=5)
            definition = agent.checks["omniflow:w-grpc"].definition
            assert definition["GRPC"] == f"127.0.0.1:{port}"
            assert definition["GRPCUseTLS"] is False
            assert definition["Interval"] == "100ms"
            assert "TTL" not in definition
            async with contextlib.aclosing(reg.watch("worker")) as watch:
                assert await anext(watch) == []  # registered, but not serving yet
                await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
                await next_until(watch, lambda listing: ids(listing) == ["w-grpc"])
                await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await next_until(watch, lambda listing: listing == [])
            await reg.deregister("w-grpc")
            assert agent.services == {}
        # No TTL passes are sent for a gRPC check.
        assert not any("/check/pass/" in path for _, path in agent.requests)
    finally:
        await server.stop(None)


async def test_unreachable_agent() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: refused
        port = sock.getsockname()[1]
        async with ConsulRegistry(f"http://127.0.0.1:{port}", timeout_s=1) as reg:
            with pytest.raises(DiscoveryError, match="list worker failed"):
                await reg.list("worker")


def test_bad_options() -> None:
    with pytest.raises(InvalidArgument, match="accepted 'ttl', 'grpc'"):
        ConsulRegistry("127.0.0.1:8500", check="http")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="bad consul address"):
        ConsulRegistry("ftp://127.0.0.1:8500")


async def test_close_ends_watches(registry: ConsulRegistry) -> None:
    watch = registry.watch("worker")
    assert await anext(watch) == []
    pending = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0.1)  # let the watch start its blocking query
    await registry.close()
    # The query in flight ends within watch_wait_s; then the watch stops.
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, EVENTUALLY_S)
    with pytest.raises(DiscoveryError, match="closed"):
        await registry.list("worker")
