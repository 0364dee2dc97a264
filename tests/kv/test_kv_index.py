"""The KV index core against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from omniflow.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind, Tier
from omniflow.kv.index_store import (
    KVIndex,
    LeaseStatus,
    OwnerInfo,
    OwnerKind,
)
from omniflow.localredis import RedisProcess, start_redis

LAYOUT = KVLayout("test/model", 2, 2, 8, "float16", 4)
NS = LAYOUT.namespace
CHAIN = block_hashes(NS, list(range(4 * 40)), 4)  # 40 blocks


@pytest.fixture
async def index(redis_server: RedisProcess) -> AsyncIterator[KVIndex]:
    client = aioredis.Redis.from_url(redis_server.url)
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    idx = KVIndex(client, prefix=prefix, default_lease_ms=5000)
    await idx.start()
    await idx.register_namespace(LAYOUT)
    try:
        yield idx
    finally:
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await client.aclose()


async def block_keys(idx: KVIndex) -> int:
    """How many per-block keys exist in Redis (stale ones included)."""
    return len([k async for k in idx._r.scan_iter(match=idx._shard(NS) + b"b:*", count=1000)])


def stored(hashes: list[bytes], tier: Tier = Tier.HOST) -> list[BlockEvent]:
    return [BlockEvent(EventKind.STORED, NS, h, tier) for h in hashes]


async def owner(idx: KVIndex, name: str, blocks: list[bytes], tier: Tier = Tier.HOST) -> int:
    """Register ``name``, snapshot ``blocks``; returns the epoch to use for events."""
    lease = await idx.register_owner(OwnerInfo(name, f"node-{name}", f"{name}:1", OwnerKind.AGENT))
    entries = [BlockEntry(NS, h, tier) for h in blocks]
    return (await idx.snapshot(name, lease.epoch, entries)).epoch


async def test_match_prefix_per_owner_and_longest(index: KVIndex) -> None:
    await owner(index, "a", CHAIN[:10])
    await owner(index, "b", CHAIN[:25], Tier.SSD)
    await owner(index, "c", CHAIN[1:30])  # lacks block 0: matches nothing
    res = await index.match_prefix(NS, CHAIN)
    assert res.longest_prefix == 25
    assert [(o.owner_id, o.matched_blocks, o.tier) for o in res.owners] == [
        ("b", 25, Tier.SSD),
        ("a", 10, Tier.HOST),
    ]
    assert res.owners[1].node == "node-a" and res.owners[1].address == "a:1"
    assert res.owners[0].blocks_per_tier == (0, 0, 25)
    assert (await index.match_prefix(NS, [])).longest_prefix == 0


async def test_events_sequence_gap_and_removal(index: KVIndex) -> None:
    epoch = await owner(index, "a", [])
    r = await index.apply_events("a", epoch, 1, stored(CHAIN[:5]))
    assert r.ok and r.applied == 5 and r.last_seq == 1
    # A hole in the chain cuts the match there.
    r = await index.apply_events("a", epoch, 2, [BlockEvent(EventKind.REMOVED, NS, CHAIN[2])])
    assert r.ok
    assert (await index.match_prefix(NS, CHAIN)).longest_prefix == 2
    # Demotion: the same block stored again with a slower tier changes the tier, not the count.
    r = await index.apply_events("a", epoch, 3, stored(CHAIN[:2], Tier.SSD))
    res = await index.match_prefix(NS, CHAIN)
    assert res.owners[0].blocks_per_tier == (0, 0, 2)
    stats = await index.stats()
    assert stats.blocks_per_tier == {"device": 0, "host": 2, "ssd": 2}
    assert stats.blocks == 4
    # seq 5 after 3: a gap, nothing applied, snapshot required.
    r = await index.apply_events("a", epoch, 5, stored(CHAIN[5:8]))
    assert r.status == LeaseStatus.SEQUENCE_GAP and r.last_seq == 3 and r.snapshot_required
    assert not r.reregister_required
    assert (await index.stats()).blocks == 4
    # The snapshot replaces the whole set; it is consistent with batch 3, so next is 4.
    snap = await index.snapshot("a", epoch, [BlockEntry(NS, h, Tier.HOST) for h in CHAIN[:8]], 3)
    assert (snap.epoch, snap.next_seq, snap.blocks) == (epoch, 4, 8)
    assert (await index.match_prefix(NS, CHAIN)).owners[0].blocks_per_tier == (0, 8, 0)
    r = await index.apply_events("a", epoch, 4, stored(CHAIN[8:9]))
    assert r.ok and r.expected_seq == 5
    stale = await index.apply_events("a", epoch - 1, 5, stored(CHAIN[9:10]))
    assert stale.status == LeaseStatus.STALE_EPOCH and stale.reregister_required
    assert (await index.match_prefix(NS, CHAIN)).longest_prefix == 9
    # The old generation's entries were all re-stored by the snapshot: the sweep keeps them.
    assert (await index.sweep()).entries_removed == 0
    assert await block_keys(index) == 9
    # Cleared drops everything.
    r = await index.apply_events("a", epoch, 5, [BlockEvent(EventKind.CLEARED)])
    assert r.ok
    assert (await index.match_prefix(NS, CHAIN)).owners == ()
    await index.sweep()
    assert (await index.stats()).blocks == 0
    assert await block_keys(index) == 0


async def test_reregistration_hides_old_entries_and_sweep_removes_them(index: KVIndex) -> None:
    await owner(index, "a", CHAIN[:20])
    await owner(index, "b", CHAIN[:3])
    assert (await index.stats()).blocks == 23
    assert await block_keys(index) == 20
    # "a" restarts: its new epoch holds nothing until its snapshot.
    lease = await index.register_owner(OwnerInfo("a", "n", "a:2"))
    res = await index.match_prefix(NS, CHAIN)
    assert [(o.owner_id, o.matched_blocks) for o in res.owners] == [("b", 3)]
    swept = await index.sweep()
    assert swept.entries_removed == 20 and swept.pending_garbage == 0
    assert (await index.stats()).blocks == 3
    assert await block_keys(index) == 3
    # The re-announced blocks count again.
    await index.snapshot("a", lease.epoch, [BlockEntry(NS, h, Tier.SSD) for h in CHAIN[:4]])
    res = await index.match_prefix(NS, CHAIN)
    assert [(o.owner_id, o.matched_blocks, o.address) for o in res.owners] == [
        ("a", 4, "a:2"),
        ("b", 3, "b:1"),
    ]


async def test_expired_lease_is_ignored_then_swept(index: KVIndex) -> None:
    lease = await index.register_owner(OwnerInfo("short", "n", "s:1"), lease_ms=300)
    await index.snapshot("short", lease.epoch, [BlockEntry(NS, h, Tier.HOST) for h in CHAIN[:6]])
    await owner(index, "long", CHAIN[:2])
    assert (await index.match_prefix(NS, CHAIN)).longest_prefix == 6
    await asyncio.sleep(0.5)
    res = await index.match_prefix(NS, CHAIN)
    assert [o.owner_id for o in res.owners] == ["long"]
    hb = await index.heartbeat("short", lease.epoch)
    assert hb.status == LeaseStatus.STALE_EPOCH and hb.reregister_required
    swept = await index.sweep()
    assert swept.owners_dropped == 1 and swept.entries_removed == 6
    stats = await index.stats()
    assert (stats.live_owners, stats.registered_owners, stats.blocks) == (1, 1, 2)
    assert await block_keys(index) == 2
    assert (await index.heartbeat("short", lease.epoch)).status == LeaseStatus.UNKNOWN_OWNER


async def test_heartbeat_keeps_lease(index: KVIndex) -> None:
    lease = await index.register_owner(OwnerInfo("hb", "n", "h:1"), lease_ms=400)
    await index.snapshot("hb", lease.epoch, [BlockEntry(NS, CHAIN[0], Tier.HOST)])
    epoch = lease.epoch
    for _ in range(4):
        await asyncio.sleep(0.2)
        assert (await index.heartbeat("hb", epoch)).status == LeaseStatus.OK
    assert (await index.match_prefix(NS, CHAIN)).longest_prefix == 1


async def test_deregister(index: KVIndex) -> None:
    await owner(index, "a", CHAIN[:5])
    await index.deregister_owner("a")
    assert (await index.match_prefix(NS, CHAIN)).owners == ()
    await index.sweep()
    assert (await index.stats()).blocks == 0
    assert await block_keys(index) == 0


async def test_bad_requests(index: KVIndex) -> None:
    unknown = KVLayout("other", 1, 1, 1).namespace
    with pytest.raises(NotFound, match="not registered"):
        await index.match_prefix(unknown, CHAIN)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        await index.match_prefix(NS, [CHAIN[0], b"short"])
    with pytest.raises(InvalidArgument, match="namespace must be 16 bytes"):
        await index.match_prefix(b"xx", CHAIN)
    with pytest.raises(InvalidArgument, match=f"at most {index.max_hashes}"):
        await index.match_prefix(NS, [CHAIN[0]] * (index.max_hashes + 1))
    with pytest.raises(InvalidArgument, match="owner id"):
        await index.register_owner(OwnerInfo("bad id\n", "n", "a"))
    epoch = await owner(index, "a", CHAIN[:3])
    with pytest.raises(NotFound):
        await index.apply_events("a", epoch, 1, [BlockEvent(EventKind.STORED, unknown, CHAIN[0])])
    with pytest.raises(FailedPrecondition, match="register again"):
        await index.snapshot("a", epoch - 1, [])
    # Nothing stored was lost by the bad calls.
    assert (await index.match_prefix(NS, CHAIN)).longest_prefix == 3


async def test_long_chain_many_owners(index: KVIndex) -> None:
    chain = block_hashes(NS, list(range(4 * 2048)), 4)
    for i in range(8):
        await owner(index, f"o{i}", chain[: 256 * (i + 1)], Tier(i % 3))
    res = await index.match_prefix(NS, chain)
    assert res.longest_prefix == 2048
    assert [o.matched_blocks for o in res.owners] == [256 * (8 - i) for i in range(8)]


async def retry_unavailable(call: Callable[[], Awaitable[Any]]) -> Any:
    """The first call after a Redis restart may hit a pooled dead connection."""
    for _ in range(3):
        try:
            return await call()
        except Unavailable:
            await asyncio.sleep(0.05)
    return await call()


async def test_redis_restart_with_empty_data(tmp_path: Path) -> None:
    server = start_redis(dir=tmp_path / "r1")
    port = server.port
    client = aioredis.Redis.from_url(server.url)
    try:
        idx = KVIndex(client)
        await idx.start()
        await idx.register_namespace(LAYOUT)
        epoch = await owner(idx, "a", CHAIN[:5])
        run_before = idx.run_id
        server.stop()
        server = start_redis(port=port, dir=tmp_path / "r2")
        # The owner learns it must re-register; the namespace survives in the core's cache.
        hb = await retry_unavailable(lambda: idx.heartbeat("a", epoch))
        assert hb.status == LeaseStatus.UNKNOWN_OWNER and hb.reregister_required
        lease = await idx.register_owner(OwnerInfo("a", "n", "a:1"))
        assert lease.run_id != run_before
        await idx.snapshot("a", lease.epoch, [BlockEntry(NS, h, Tier.HOST) for h in CHAIN[:5]])
        assert (await idx.match_prefix(NS, CHAIN)).longest_prefix == 5
        assert (await client.hlen(b"of:kv:ns")) == 1
        # A fresh index process on the restored Redis sees the namespace.
        idx2 = KVIndex(client)
        await idx2.start()
        assert (await idx2.layout(NS)) == LAYOUT and idx2.run_id == lease.run_id
    finally:
        await client.aclose()
        server.stop()


async def test_owner_registered_before_a_namespace_is_taken_into_it(index: KVIndex) -> None:
    # Each namespace is a shard of its own (its own slot on a Redis Cluster). An agent that
    # registered before a model's namespace existed publishes into it without registering
    # again; a shard that lost its data (its run marker gone) makes it register again.
    epoch = await owner(index, "agent", CHAIN[:2])
    later = KVLayout("later/model", 2, 2, 8, "float16", 4)
    await index.register_namespace(later)
    chain = block_hashes(later.namespace, list(range(4 * 5)), 4)
    evs = [BlockEvent(EventKind.STORED, later.namespace, h, Tier.HOST) for h in chain]
    assert (await index.apply_events("agent", epoch, 1, evs)).ok
    assert (await index.match_prefix(later.namespace, chain)).longest_prefix == 5
    assert (await index.match_prefix(NS, CHAIN)).longest_prefix == 2
    assert (await index.heartbeat("agent", epoch)).status == LeaseStatus.OK
    assert (await index.apply_events("agent", epoch, 2, stored(CHAIN[2:3]))).ok
    assert (await index.stats()).blocks == 8
    shard = index._shard(later.namespace)
    async for key in index._r.scan_iter(match=shard + b"*", count=1000):
        await index._r.delete(key)
    hb = await index.heartbeat("agent", epoch)
    assert hb.status == LeaseStatus.UNKNOWN_OWNER and hb.reregister_required
