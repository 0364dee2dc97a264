"""The KV index core on a Redis Cluster: three real `redis-server --cluster-enabled yes`
nodes joined by `redis-cli --cluster create`, reached through redis-py's cluster client
from a `redis+cluster://` URL. Every test of the single-Redis suite (test_kv_index.py)
runs again here against the cluster; then the keys are checked to sit in one slot per hash
tag — the control slot's, and one per namespace shard — so that no script crossed slots
(Redis would have refused it), and two namespaces are shown on two masters."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import test_kv_index as single  # the single-Redis suite beside this file

from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind, Tier
from omniflow.kv.index_store import KVIndex, OwnerInfo
from omniflow.localredis import redis_client
from omniflow.testing.redis_cluster import local_cluster, missing_reason

# The single-Redis suite's tests, run here with this module's `index` fixture. The one
# that restarts its own Redis is single-Redis by nature.
for _name, _fn in vars(single).items():
    if _name.startswith("test_") and _name != "test_redis_restart_with_empty_data":
        globals()[_name] = _fn


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[list[int]]:
    """Three master nodes covering the 16384 slots; stopped by PID at the end."""
    reason = missing_reason(str(redis_binary))
    if reason:
        pytest.skip(reason)
    with local_cluster(tmp_path_factory.mktemp("redis-cluster"), 3, str(redis_binary)) as c:
        yield list(c.ports)


@pytest.fixture
async def index(cluster: list[int]) -> AsyncIterator[KVIndex]:
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in cluster[:2])
    client = redis_client(url, 5.0, decode_responses=False)
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    idx = KVIndex(client, prefix=prefix, default_lease_ms=5000)
    await idx.start()
    await idx.register_namespace(single.LAYOUT)
    try:
        yield idx
    finally:
        _assert_slot_per_tag(cluster, idx._p[:-1])
        for port in cluster:
            node = redis.Redis(port=port)
            for key in node.scan_iter(match=idx._p[:-1] + b"*", count=1000):
                node.delete(key)
        await client.aclose()


def _assert_slot_per_tag(ports: list[int], start: bytes) -> dict[bytes, int]:
    """Every key of this index (``start``: its hash tag's opening) sits in the one slot of
    its hash tag; returns the port of the master holding each tag."""
    assert start.startswith(b"{"), start
    where: dict[bytes, set[tuple[int, int]]] = {}
    for port in ports:
        node = redis.Redis(port=port)
        for key in node.scan_iter(match=start + b"*", count=1000):
            tag = key[: key.index(b"}") + 1]
            where.setdefault(tag, set()).add((port, node.execute_command("CLUSTER KEYSLOT", key)))
    for tag, places in where.items():
        assert len(places) == 1, f"keys of {tag!r} in more than one slot: {places}"
    return {tag: next(iter(places))[0] for tag, places in where.items()}


async def test_prefix_becomes_a_hash_tag(index: KVIndex) -> None:
    assert index._p.startswith(b"{t") and index._p.endswith(b":}")
    assert index._shard(single.NS) == index._p[:-1] + b"n:" + single.NS.hex().encode() + b"}:"
    lease = await single.owner(index, "x", single.CHAIN[:3])
    assert lease >= 1
    assert (await index.match_prefix(single.NS, single.CHAIN)).longest_prefix == 3


async def test_namespaces_spread_over_the_masters(index: KVIndex, cluster: list[int]) -> None:
    # Namespaces of different models are shards of their own: their keys land in their own
    # slots, which the cluster spreads over its masters. Eight models: at least two masters
    # (all eight on one of three masters would be a 1-in-2187 draw for this prefix).
    layouts = [KVLayout(f"model-{i}", 2, 2, 8, "float16", 4) for i in range(8)]
    for lay in layouts:
        await index.register_namespace(lay)
    lease = await index.register_owner(OwnerInfo("agent-1", "n1", "a:1"))
    chains = {lay.namespace: block_hashes(lay.namespace, list(range(4 * 6)), 4) for lay in layouts}
    entries = [BlockEntry(ns, h, Tier.HOST) for ns, chain in chains.items() for h in chain]
    await index.snapshot("agent-1", lease.epoch, entries)
    for ns, chain in chains.items():
        res = await index.match_prefix(ns, chain)
        assert [(o.owner_id, o.matched_blocks) for o in res.owners] == [("agent-1", 6)]
    masters = _assert_slot_per_tag(cluster, index._p[:-1])
    shard_masters = {masters[index._shard(lay.namespace)[:-1]] for lay in layouts}
    assert len(shard_masters) >= 2, masters
    # One batch across namespaces lands in each one's shard; the owner's sequence holds.
    ns0, ns1 = layouts[0].namespace, layouts[1].namespace
    gone = [
        BlockEvent(EventKind.REMOVED, ns0, chains[ns0][2]),
        BlockEvent(EventKind.REMOVED, ns1, chains[ns1][4]),
    ]
    assert (await index.apply_events("agent-1", lease.epoch, 1, gone)).ok
    assert (await index.match_prefix(ns0, chains[ns0])).longest_prefix == 2
    assert (await index.match_prefix(ns1, chains[ns1])).longest_prefix == 4
    stats = await index.stats()
    assert (stats.live_owners, stats.blocks, stats.namespaces) == (1, 8 * 6 - 2, 9)
