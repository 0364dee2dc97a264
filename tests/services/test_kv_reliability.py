"""Data Flow under faults, with real processes: a kv-index and kv-agents on a private Redis.

SIGKILL of an agent, a page corrupted at its source, Redis restarted empty, an agent
restarted on the same SSD file, and malformed requests.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from inprocess import eventually

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.errors import Unavailable
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.checksum import page_checksum
from omniflow.kv.client import KVClient, SourceKind
from omniflow.localredis import start_redis
from omniflow.rpc.client import open_channel

LAYOUT = KVLayout("rel-model", num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)
NS = LAYOUT.namespace
LEASE_MS = 3000
SHM = Path("/dev/shm")


def chain(n: int, seed: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 32000, n * LAYOUT.page_size).tolist()
    return block_hashes(NS, tokens, LAYOUT.page_size)


def pages(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(500 + seed)
    return [rng.integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8).tobytes() for _ in range(n)]


class Topology:
    """Index and agent processes of one test; shared-memory files removed at the end."""

    def __init__(self, spawn) -> None:
        self.spawn = spawn
        self.tag = uuid.uuid4().hex[:6]
        self.index_address = ""
        self.procs: dict[str, object] = {}

    async def start_index(self, **env: str) -> str:
        proc = self.spawn(
            "kv_index", f"kvi-{self.tag}", OMNIFLOW_KV_LEASE_TTL_MS=str(LEASE_MS),
            OMNIFLOW_KV_SWEEP_INTERVAL_S="0.2", **env,
        )  # fmt: skip
        self.index_address = (await asyncio.to_thread(proc.wait_ready)).address
        channel = open_channel(self.index_address)
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        await stub.RegisterNamespace(
            kvindex_pb2.RegisterNamespaceRequest(
                layout=common_pb2.KVLayout(
                    model_id=LAYOUT.model_id, num_layers=2, num_kv_heads=2, head_dim=16,
                    dtype="float32", page_size=16,
                )
            )
        )  # fmt: skip
        await channel.close()
        return self.index_address

    def agent_id(self, name: str) -> str:
        return f"{name}-{self.tag}"

    async def start_agent(self, name: str, run: int = 1, **env: str) -> str:
        """Start agent ``name``; a later ``run`` restarts it under the same instance id."""
        proc = self.spawn(
            "kv_agent", f"{self.agent_id(name)}-run{run}", OMNIFLOW_NODE_ID=f"node-{name}",
            OMNIFLOW_INSTANCE_ID=self.agent_id(name),
            OMNIFLOW_KV_HOST_BYTES=str(64 * LAYOUT.page_bytes), **env,
        )  # fmt: skip
        self.procs[name] = proc
        return (await asyncio.to_thread(proc.wait_ready)).address

    def cleanup(self) -> None:
        for path in SHM.glob(f"omniflow-*-{self.tag}*"):
            path.unlink(missing_ok=True)


@pytest.fixture
def topo(spawn):
    t = Topology(spawn)
    yield t
    t.cleanup()


async def _match(index_address: str, hashes: list[bytes]) -> dict[str, tuple[int, int]]:
    async with open_channel(index_address) as channel:
        reply = await kvindex_pb2_grpc.KVIndexServiceStub(channel).MatchPrefix(
            kvindex_pb2.MatchPrefixRequest(namespace=NS.hex(), block_hashes=hashes)
        )
    return {o.owner_id: (o.matched_blocks, o.tier) for o in reply.owners}


async def _announced(topo: Topology, name: str, hashes: list[bytes], n: int) -> None:
    owner = topo.agent_id(name)

    async def check() -> bool:
        return (await _match(topo.index_address, hashes)).get(owner, (0, 0))[0] == n

    await eventually(check, 10, f"{owner} announces {n} blocks")


@pytest.mark.integration
async def test_sigkilled_agent_vanishes_within_lease_and_pullers_get_an_error(topo, private_redis):
    await topo.start_index()
    a = await topo.start_agent("a")
    b = await topo.start_agent("b")
    hashes, data = chain(12, 1), pages(12, 1)
    async with KVClient(b, topo.index_address) as producer:
        assert await producer.put(NS, hashes, data) == 12
    await _announced(topo, "b", hashes, 12)

    topo.procs["b"].popen.send_signal(signal.SIGKILL)
    await asyncio.to_thread(topo.procs["b"].popen.wait, 10)
    async with KVClient(a, topo.index_address) as consumer:
        # The index still names b (its lease runs): the pull fails with an error the caller
        # answers by recomputing, and nothing half-pulled is served.
        plan = await consumer.plan(NS, hashes)
        if plan.best.kind == SourceKind.REMOTE:
            with pytest.raises(Unavailable, match="source agent"):
                await consumer.acquire(NS, hashes)
        async with await consumer.locate(NS, hashes) as local:
            assert len(local) == 0

        async def gone() -> bool:
            return topo.agent_id("b") not in await _match(topo.index_address, hashes)

        # Nobody released b's lease: only its TTL (plus the poll) removes its blocks.
        await eventually(gone, LEASE_MS / 1000 + 1.5, "b's blocks leave MatchPrefix")
        async with await consumer.acquire(NS, hashes) as after:
            assert len(after) == 0 and after.source.kind == SourceKind.NONE


@pytest.mark.integration
async def test_page_corrupted_at_the_source_is_detected_dropped_and_counted(topo, private_redis):
    await topo.start_index()
    a = await topo.start_agent("a", OMNIFLOW_KV_CHANNELS="grpc")
    b = await topo.start_agent("b", OMNIFLOW_KV_CHANNELS="grpc")
    hashes, data = chain(5, 2), pages(5, 2)
    async with KVClient(b, topo.index_address) as producer:
        await producer.put(NS, hashes, data)
        async with await producer.locate(NS, hashes) as held:  # b's arena, mapped here
            held.views[2][7] ^= 0x01
    await _announced(topo, "b", hashes, 5)
    async with KVClient(a, topo.index_address) as consumer:
        async with await consumer.acquire(NS, hashes) as got:
            assert len(got) == 2
            assert [v.tobytes() for v in got.views] == data[:2]
        async with open_channel(a) as channel:
            stats = await kvagent_pb2_grpc.KVAgentServiceStub(channel).Stats(
                kvagent_pb2.StatsRequest()
            )
    # The four good pages are kept (valid, just not served past the gap); the bad one is not.
    assert stats.checksum_failures == 1 and stats.pages_received == 4


@pytest.mark.integration
async def test_redis_restarted_empty_agents_reannounce_within_10s(topo, private_redis, tmp_path):
    await topo.start_index()
    addrs = {n: await topo.start_agent(n, OMNIFLOW_KV_INDEX_ADDR=topo.index_address) for n in "ab"}
    chains = {"a": chain(20, 3), "b": chain(30, 4)}
    for name, address in addrs.items():
        async with KVClient(address, topo.index_address) as client:
            await client.put(NS, chains[name], pages(len(chains[name]), 5))
        await _announced(topo, name, chains[name], len(chains[name]))

    port = private_redis.port
    private_redis.stop()
    fresh = start_redis(port=port, dir=tmp_path / "redis-2")  # nothing on disk
    try:

        async def complete() -> bool:
            try:
                for name, hashes in chains.items():
                    got = await _match(topo.index_address, hashes)
                    if got.get(topo.agent_id(name), (0, 0))[0] != len(hashes):
                        return False
            except grpc.aio.AioRpcError:
                return False
            return True

        await eventually(complete, 10, "the index is complete again after Redis lost its data")
    finally:
        for proc in topo.procs.values():  # stop them while their Redis still runs
            proc.popen.send_signal(signal.SIGTERM)
        for proc in topo.procs.values():
            await asyncio.to_thread(proc.popen.wait, 15)
        fresh.stop()


@pytest.mark.integration
async def test_agent_restarted_on_its_ssd_file_announces_and_serves_it(
    topo, private_redis, tmp_path
):
    await topo.start_index()
    ssd = {"OMNIFLOW_KV_SSD_PATH": str(tmp_path / "ssd"), "OMNIFLOW_KV_SSD_BYTES": str(8 << 20)}
    a = await topo.start_agent("a", **ssd)
    hashes, data = chain(10, 6), pages(10, 6)
    async with KVClient(a, topo.index_address) as client:
        await client.put(NS, hashes, data)
        async with open_channel(a) as channel:
            reply = await kvagent_pb2_grpc.KVAgentServiceStub(channel).Evict(
                kvagent_pb2.EvictRequest(
                    namespace=NS.hex(), block_hashes=hashes, tier=common_pb2.TIER_HOST
                )
            )
        assert reply.demoted == 10
    first = topo.procs["a"]
    first.popen.send_signal(signal.SIGKILL)
    await asyncio.to_thread(first.popen.wait, 10)

    a2 = await topo.start_agent("a", run=2, **ssd)  # same id, same SSD file
    await _announced(topo, "a", hashes, 10)
    assert (await _match(topo.index_address, hashes))[topo.agent_id("a")][1] == common_pb2.TIER_SSD
    b = await topo.start_agent("b")
    async with KVClient(b, topo.index_address) as consumer:
        async with await consumer.acquire(NS, hashes) as got:
            assert [v.tobytes() for v in got.views] == data
    async with KVClient(a2) as local, await local.locate(NS, hashes) as held:
        assert [v.tobytes() for v in held.views] == data


@pytest.mark.integration
async def test_malformed_requests_get_clear_errors_and_lose_nothing(topo, private_redis):
    await topo.start_index()
    a = await topo.start_agent("a")
    hashes, data = chain(3, 7), pages(3, 7)
    async with KVClient(a, topo.index_address) as client:
        await client.put(NS, hashes, data)
    async with open_channel(a) as ach, open_channel(topo.index_address) as ich:
        agent = kvagent_pb2_grpc.KVAgentServiceStub(ach)
        index = kvindex_pb2_grpc.KVIndexServiceStub(ich)
        cases = [
            (index.MatchPrefix(kvindex_pb2.MatchPrefixRequest(
                namespace=NS.hex(), block_hashes=[b"\x01" * 20])),
             grpc.StatusCode.INVALID_ARGUMENT, "20 bytes"),
            (index.MatchPrefix(kvindex_pb2.MatchPrefixRequest(
                namespace="cd" * 16, block_hashes=hashes)),
             grpc.StatusCode.NOT_FOUND, "not registered"),
            (agent.PutPages(iter([kvagent_pb2.PageChunk(
                namespace=NS.hex(), block_hash=chain(4, 8)[3], data=b"x" * 100,
                page_bytes=100, checksum=page_checksum(b"x" * 100), last=True)])),
             grpc.StatusCode.INVALID_ARGUMENT, "pages of 8192 bytes"),
            (agent.PutPages(iter([kvagent_pb2.PageChunk(
                namespace=NS.hex(), block_hash=chain(4, 8)[3], data=b"x" * (17 << 20),
                page_bytes=LAYOUT.page_bytes)])),
             grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit"),
            (agent.DeleteTensor(kvagent_pb2.DeleteTensorRequest()), None, ""),
            (agent.LocatePages(kvagent_pb2.LocatePagesRequest(namespace="nope")),
             grpc.StatusCode.INVALID_ARGUMENT, "hex digits"),
        ]  # fmt: skip
        for call, code, text in cases:
            if code is None:
                assert not (await call).found
                continue
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == code and text in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in agent.GetTensor(
                kvagent_pb2.GetTensorRequest(ref=common_pb2.TensorRef(handle="missing"))
            ):
                pass
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'missing' is unknown or expired" in info.value.details()
    async with KVClient(a) as client, await client.locate(NS, hashes) as held:
        assert [v.tobytes() for v in held.views] == data
