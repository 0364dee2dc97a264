"""The KV index core on a Redis Cluster: three real `redis-server --cluster-enabled yes`
nodes joined by `redis-cli --cluster create`, reached through redis-py's cluster client
from a `redis+cluster://` URL. Every test of the single-Redis suite (test_kv_index.py)
runs again here against the cluster; then the keys are checked to sit in one slot, on
the one node that owns it, so that no script crossed slots (Redis would have refused it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import test_kv_index as single  # the single-Redis suite beside this file

from omniflow.kv.index_store import KVIndex
from omniflow.localredis import redis_client

REDIS_CLI = shutil.which("redis-cli")

# The single-Redis suite's tests, run here with this module's `index` fixture. The one
# that restarts its own Redis is single-Redis by nature.
for _name, _fn in vars(single).items():
    if _name.startswith("test_") and _name != "test_redis_restart_with_empty_data":
        globals()[_name] = _fn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[list[int]]:
    """Three master nodes covering the 16384 slots; stopped by PID and removed at the end."""
    if REDIS_CLI is None:
        pytest.skip("needs redis-cli (the redis-tools package) to create the cluster")
    root = tmp_path_factory.mktemp("redis-cluster")
    ports = [_free_port() for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            d = root / str(port)
            d.mkdir()
            procs.append(
                subprocess.Popen(
                    [str(redis_binary), "--port", str(port), "--bind", "127.0.0.1",
                     "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no",
                     "--dir", str(d)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
        for port in ports:
            _wait_ping(port)
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not all(_info(p).get("cluster_state") == "ok" for p in ports):
            if time.monotonic() > deadline:
                pytest.fail(f"the cluster did not reach cluster_state:ok: {_info(ports[0])}")
            time.sleep(0.2)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ping(port: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _info(port: int) -> dict[str, str]:
    info = redis.Redis(port=port, socket_timeout=2, decode_responses=True).cluster("info")
    return {str(k): str(v) for k, v in info.items()}


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
