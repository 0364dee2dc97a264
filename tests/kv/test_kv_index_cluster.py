"""The KV index core on a Redis Cluster: three real `redis-server --cluster-enabled yes`
nodes joined by `redis-cli --cluster create`, reached through redis-py's cluster client
from a `redis+cluster://` URL. Every test of the single-Redis suite (test_kv_index.py)
runs again here against the cluster; then the keys are checked to sit in one slot, on
the one node that owns it, so that no script crossed slots (Redis would have refused it)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import test_kv_index as single  # the single-Redis suite beside this file

from omniflow.kv.index_store import KVIndex
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
        _assert_one_slot(cluster, idx._p)
        for port in cluster:
            node = redis.Redis(port=port)
            for key in node.scan_iter(match=idx._p + b"*", count=1000):
                node.delete(key)
        await client.aclose()


def _assert_one_slot(ports: list[int], prefix: bytes) -> None:
    """Every key of this index is on one node and in one slot: the prefix's hash tag."""
    assert prefix.startswith(b"{") and b"}" in prefix, prefix
    holders = {}
    for port in ports:
        node = redis.Redis(port=port)
        keys = list(node.scan_iter(match=prefix + b"*", count=1000))
        if keys:
            slots = {node.execute_command("CLUSTER KEYSLOT", k) for k in keys[:200]}
            holders[port] = (len(keys), slots)
    assert len(holders) == 1, f"keys on more than one node: {holders}"
    ((_count, slots),) = holders.values()
    assert len(slots) == 1, slots


async def test_prefix_becomes_a_hash_tag(index: KVIndex) -> None:
    assert index._p.startswith(b"{t") and index._p.endswith(b":}")
    lease = await single.owner(index, "x", single.CHAIN[:3])
    assert lease >= 1
    assert (await index.match_prefix(single.NS, single.CHAIN)).longest_prefix == 3
