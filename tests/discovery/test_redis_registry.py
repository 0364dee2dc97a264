"""Redis discovery backend, end to end against a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from discovery_helpers import EVENTUALLY_S, ids, next_until

from omniflow.discovery import DiscoveryError, ServiceInstance, make_registry
from omniflow.discovery.redis_backend import RedisRegistry
from omniflow.errors import InvalidArgument
from omniflow.localredis import RedisProcess, start_redis


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def raw(redis_server: RedisProcess, prefix: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client, for looking under the hood; deletes the test's keys at the end."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=5)
    yield client
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
async def registry(
    redis_server: RedisProcess, prefix: str, raw: aioredis.Redis
) -> AsyncIterator[RedisRegistry]:
    reg = RedisRegistry(redis_server.url, prefix=prefix, poll_interval_s=0.2, timeout_s=5)
    yield reg
    await reg.close()


def inst(service: str, instance_id: str, port: int = 50051, **meta: str) -> ServiceInstance:
    return ServiceInstance(service, instance_id, f"127.0.0.1:{port}", dict(meta))


async def test_register_list_watch_deregister(registry: RedisRegistry) -> None:
    worker = inst("worker", "llm-0", role="llm", model="tiny")
    async with contextlib.aclosing(registry.watch("worker")) as watch:
        assert await anext(watch) == []  # the current (empty) listing, at once
        await registry.register(worker, ttl_s=5)
        assert await registry.list("worker") == [worker]
        seen = await next_until(watch, lambda listing: listing != [])
        assert seen == [worker]
        assert seen[0].metadata == {"role": "llm", "model": "tiny"}

        await registry.deregister("llm-0")
        assert await registry.list("worker") == []  # gone at once, no TTL wait
        assert await next_until(watch, lambda listing: listing == []) == []


async def test_key_layout(registry: RedisRegistry, raw: aioredis.Redis, prefix: str) -> None:
    await registry.register(inst("router", "r-0"), ttl_s=5)
    key = f"{prefix}:svc:router:r-0"
    assert 0 < await raw.pttl(key) <= 5000
    assert await raw.smembers(f"{prefix}:svcidx:router") == {"r-0"}
    await registry.deregister("r-0")
    assert await raw.exists(key) == 0
    assert await raw.smembers(f"{prefix}:svcidx:router") == set()


async def test_services_do_not_mix(registry: RedisRegistry) -> None:
    router, w0, w1 = inst("router", "r-0"), inst("worker", "w-0"), inst("worker", "w-1", 50052)
    for i in (w1, router, w0):
        await registry.register(i, ttl_s=5)
    assert await registry.list("router") == [router]
    assert await registry.list("worker") == [w0, w1]
    assert await registry.list("encoder") == []
    await registry.deregister("r-0")
    assert await registry.list("worker") == [w0, w1]


async def test_refresher_keeps_registration_alive_past_ttl(registry: RedisRegistry) -> None:
    await registry.register(inst("worker", "w-0"), ttl_s=0.6)
    await asyncio.sleep(2.0)  # more than three TTLs: only the refresher keeps it there
    assert ids(await registry.list("worker")) == ["w-0"]


async def test_close_without_deregister_lapses_after_ttl(
    redis_server: RedisProcess, registry: RedisRegistry, prefix: str, raw: aioredis.Redis
) -> None:
    dying = RedisRegistry(redis_server.url, prefix=prefix)
    await dying.register(inst("worker", "w-dead"), ttl_s=0.5)
    await registry.register(inst("worker", "w-live"), ttl_s=5)
    await dying.close()  # stops the refresher, does not deregister
    async with contextlib.aclosing(registry.watch("worker")) as watch:
        await next_until(watch, lambda listing: ids(listing) == ["w-live"])
    # Listing pruned the dead member from the index set.
    assert await raw.smembers(f"{prefix}:svcidx:worker") == {"w-live"}


_KILLED_CHILD = """
import asyncio, sys
from omniflow.discovery import ServiceInstance, make_registry

async def main() -> None:
    reg = make_registry("redis", url=sys.argv[1], prefix=sys.argv[2])
    await reg.register(ServiceInstance("worker", "w-child", "127.0.0.1:50070"), ttl_s=1.0)
    print("registered", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_sigkilled_process_disappears_after_ttl(
    redis_server: RedisProcess, registry: RedisRegistry, prefix: str, raw: aioredis.Redis
) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _KILLED_CHILD, redis_server.url, prefix,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        assert line.strip() == b"registered"
        async with contextlib.aclosing(registry.watch("worker")) as watch:
            assert ids(await anext(watch)) == ["w-child"]
            # Outlive several TTLs to show the child's refresher is what keeps it.
            await asyncio.sleep(2.5)
            assert ids(await registry.list("worker")) == ["w-child"]
            os.kill(child.pid, signal.SIGKILL)
            assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGKILL
            await next_until(watch, lambda listing: listing == [])
        assert await raw.exists(f"{prefix}:svc:worker:w-child") == 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


async def test_reregister_replaces(registry: RedisRegistry) -> None:
    await registry.register(inst("worker", "w-0", role="llm"), ttl_s=5)
    await registry.register(inst("worker", "w-0", 50099, role="encoder"), ttl_s=5)
    [only] = await registry.list("worker")
    assert only.address == "127.0.0.1:50099" and only.metadata == {"role": "encoder"}
    # Moving an id to another service removes it from the first.
    await registry.register(inst("encoder", "w-0"), ttl_s=5)
    assert await registry.list("worker") == []
    assert ids(await registry.list("encoder")) == ["w-0"]


async def test_deregister_from_another_process(
    redis_server: RedisProcess, registry: RedisRegistry, prefix: str
) -> None:
    async with RedisRegistry(redis_server.url, prefix=prefix) as other:
        await other.deregister("w-0")  # unknown id: ignored
        await registry.register(inst("worker", "w-0"), ttl_s=5)
        await other.deregister("w-0")  # not registered by `other`: found by scan
        assert await registry.list("worker") == []


async def test_bad_record_is_skipped(
    registry: RedisRegistry, raw: aioredis.Redis, prefix: str
) -> None:
    await registry.register(inst("worker", "w-0"), ttl_s=5)
    await raw.set(f"{prefix}:svc:worker:junk", "{not json", px=5000)
    await raw.sadd(f"{prefix}:svcidx:worker", "junk")
    assert ids(await registry.list("worker")) == ["w-0"]


async def test_unreachable_redis_raises_discovery_error() -> None:
    with contextlib.closing(__import__("socket").socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        async with RedisRegistry(f"redis://:secret@127.0.0.1:{port}/0", timeout_s=1) as reg:
            with pytest.raises(DiscoveryError, match="list worker failed") as info:
                await reg.list("worker")
            assert "secret" not in str(info.value)
            with pytest.raises(DiscoveryError):
                await reg.register(inst("worker", "w-0"), ttl_s=5)
            with pytest.raises(DiscoveryError):
                await anext(reg.watch("worker"))


async def test_closed_registry_refuses_calls(registry: RedisRegistry) -> None:
    await registry.close()
    with pytest.raises(DiscoveryError, match="closed"):
        await registry.list("worker")


async def test_bad_arguments(registry: RedisRegistry) -> None:
    with pytest.raises(InvalidArgument, match="ttl_s"):
        await registry.register(inst("worker", "w-0"), ttl_s=0)
    with pytest.raises(InvalidArgument, match="service name"):
        await registry.list("bad:name")


def test_make_registry(redis_server: RedisProcess) -> None:
    reg = make_registry("redis", url=redis_server.url)
    assert isinstance(reg, RedisRegistry)
    asyncio.run(reg.close())
    with pytest.raises(InvalidArgument, match="accepted values are redis, consul, static"):
        make_registry("etcd")
    with pytest.raises(InvalidArgument, match="bad options for redis"):
        make_registry("redis", nonsense=1)


def test_service_instance_value_semantics() -> None:
    meta = {"role": "llm"}
    a = ServiceInstance("worker", "w-0", "127.0.0.1:1", meta)
    meta["role"] = "changed"
    assert a.metadata == {"role": "llm"}  # a private copy
    b = ServiceInstance("worker", "w-0", "127.0.0.1:1", {"role": "llm"})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != ServiceInstance("worker", "w-0", "127.0.0.1:1", {"role": "other"})
    assert (a.host, a.port) == ("127.0.0.1", 1)
    assert ServiceInstance("w", "i", "[::1]:80").host == "::1"
    assert ServiceInstance.from_dict(a.to_dict()) == a
    with pytest.raises(InvalidArgument, match="host:port"):
        ServiceInstance("worker", "w-0", "no-port")
    with pytest.raises(InvalidArgument, match="str to str"):
        ServiceInstance("worker", "w-0", "h:1", {"n": 1})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument, match="instance id"):
        ServiceInstance("worker", "w:0", "h:1")


async def test_close_ends_watches(registry: RedisRegistry) -> None:
    watch = registry.watch("worker")
    assert await anext(watch) == []
    pending = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0)  # let the watch block on its subscription
    await registry.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, EVENTUALLY_S)


async def test_survives_redis_restart(tmp_path: Path) -> None:
    """A watch and a refresher ride out a Redis restart (all data lost) on the same port."""
    first = start_redis(dir=tmp_path / "a")
    port, second = first.port, None
    try:
        async with RedisRegistry(first.url, poll_interval_s=0.1, timeout_s=1) as reg:
            await reg.register(inst("worker", "w-0"), ttl_s=0.6)
            async with contextlib.aclosing(reg.watch("worker")) as watch:
                assert ids(await anext(watch)) == ["w-0"]
                first.stop()
                second = start_redis(port=port, dir=tmp_path / "b")
                # The new server starts empty; the refresher writes w-0 back and the
                # watch, after failing while Redis was down, lists it again.
                assert ids(await registry_list_eventually(reg, "worker")) == ["w-0"]
                await reg.deregister("w-0")
                await next_until(watch, lambda listing: listing == [])
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def registry_list_eventually(reg: RedisRegistry, service: str) -> list[ServiceInstance]:
    """Poll ``list`` until non-empty; each call must succeed (the client retries reconnects)."""
    for _ in range(round(EVENTUALLY_S / 0.05)):
        if listing := await reg.list(service):
            return listing
        await asyncio.sleep(0.05)
    raise AssertionError(f"{service} stayed empty")
