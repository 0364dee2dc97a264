"""The router's direct Redis path reads the index's keys through the library's store, under
the index's key prefix and with a socket deadline on its client; its gRPC path looks the
index up once, not per pick."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import redis.asyncio as aioredis

from omniflow.config import load_settings
from omniflow.errors import NotFound, Unavailable
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.events import BlockEntry, Tier
from omniflow.kv.index_store import KVIndex, OwnerInfo, OwnerKind
from omniflow.localredis import RedisProcess
from omniflow.routing.prefix import GrpcPrefixIndex, RedisPrefixIndex
from omniflow.rpc.server import ServiceHost
from omniflow_services.kv_index.config import KVIndexSettings
from omniflow_services.kv_index.server import KVIndexApp

LAYOUT = KVLayout("test/model", 2, 2, 8, "float16", 4)
CHAIN = block_hashes(LAYOUT.namespace, list(range(4 * 6)), 4)  # 6 blocks


async def _agent_holds(index: KVIndex, blocks: int) -> None:
    """``index`` started, with agent ``agent-n0`` (node n0) holding CHAIN's first ``blocks``
    in its host tier."""
    await index.start()
    await index.register_namespace(LAYOUT)
    lease = await index.register_owner(
        OwnerInfo("agent-n0", "n0", "127.0.0.1:7000", OwnerKind.AGENT)
    )
    entries = [BlockEntry(LAYOUT.namespace, h, Tier.HOST) for h in CHAIN[:blocks]]
    await index.snapshot("agent-n0", lease.epoch, entries)


async def test_redis_path_answers_under_the_index_prefix(redis_server: RedisProcess) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    client = aioredis.Redis.from_url(redis_server.url)
    index = KVIndex(client, prefix=prefix)
    router = RedisPrefixIndex(redis_server.url, timeout_s=2.0, key_prefix=prefix)
    other = RedisPrefixIndex(redis_server.url, timeout_s=2.0, key_prefix=f"u{prefix}")
    try:
        await _agent_holds(index, 4)

        owners = await router.match(LAYOUT.namespace, CHAIN)
        assert [(o.owner_id, o.kind, o.node, o.matched_blocks) for o in owners] == [
            ("agent-n0", "agent", "n0", 4)
        ]
        assert owners[0].blocks_per_tier == (0, 4, 0)
        # Every command of the router's client has a deadline.
        kwargs = router._redis.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 2.0
        # Under another prefix the namespace is unknown: nothing is read from these keys.
        with pytest.raises(NotFound):
            await other.match(LAYOUT.namespace, CHAIN)
    finally:
        await router.close()
        await other.close()
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await client.aclose()


async def _index_host(redis_url: str, prefix: str) -> ServiceHost:
    settings = dataclasses.replace(
        load_settings(KVIndexSettings, env={}),
        redis_url=redis_url,
        port=0,
        metrics_port=-1,
        instance_id=f"kvi-{prefix.rstrip(':')}-{uuid.uuid4().hex[:4]}",
        key_prefix=prefix,
    )
    host = ServiceHost(KVIndexApp(settings), settings)
    await host.start()
    return host


async def test_grpc_path_resolves_the_index_once_and_again_after_it_moved(
    redis_server: RedisProcess,
) -> None:
    """The kv-index's address is looked up once, not before every pick; when the index is
    gone the failed match drops the channel and the next one finds the new address."""
    prefix = f"g{uuid.uuid4().hex[:8]}:"
    client = aioredis.Redis.from_url(redis_server.url)
    store = KVIndex(client, prefix=prefix)
    hosts = [await _index_host(redis_server.url, prefix)]
    resolved: list[str] = []

    async def resolve() -> str:
        resolved.append(hosts[-1].address)
        return hosts[-1].address

    router = GrpcPrefixIndex(resolve)
    try:
        await _agent_holds(store, 3)
        for _ in range(3):
            owners = await router.match(LAYOUT.namespace, CHAIN)
            assert [(o.owner_id, o.matched_blocks) for o in owners] == [("agent-n0", 3)]
        assert resolved == [hosts[0].address]  # one lookup for three picks

        await hosts.pop().stop()
        moved = await _index_host(redis_server.url, prefix)  # another port
        hosts.append(moved)
        with pytest.raises(Unavailable):
            await router.match(LAYOUT.namespace, CHAIN)
        owners = await router.match(LAYOUT.namespace, CHAIN)
        assert [(o.owner_id, o.matched_blocks) for o in owners] == [("agent-n0", 3)]
        assert resolved[1:] == [moved.address] and len(resolved) == 2
    finally:
        await router.close()
        for host in hosts:
            await host.stop()
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await client.aclose()
