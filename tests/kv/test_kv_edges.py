"""The kv-index and kv-agent gRPC edges in-process (port 0) on a real Redis, driven through
the generated stubs and the worker client library."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from inprocess import eventually
from kv_helpers import LAYOUT, chain, pages

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.kv.checksum import page_checksum
from omniflow.kv.client import KVClient, SourceKind
from omniflow.kv.wire import layout_to_proto
from omniflow.rpc.client import open_channel
from omniflow_services.kv_agent.host_tier import HostArena
from omniflow_services.kv_agent.nixl_channel import nixl_unavailable_reason

NS = LAYOUT.namespace


async def _index_stub(cluster):
    channel = open_channel(cluster.index.address)
    return channel, kvindex_pb2_grpc.KVIndexServiceStub(channel)


async def _register(stub) -> None:
    await stub.RegisterNamespace(
        kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(LAYOUT))
    )


async def _owners(stub, hashes) -> dict[str, int]:
    reply = await stub.MatchPrefix(
        kvindex_pb2.MatchPrefixRequest(namespace=NS.hex(), block_hashes=hashes)
    )
    return {o.owner_id: o.matched_blocks for o in reply.owners}


async def test_index_protocol_and_bad_input(kv_cluster):
    channel, stub = await _index_stub(kv_cluster)
    async with channel:
        reply = await stub.RegisterNamespace(
            kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(LAYOUT))
        )
        assert reply.namespace == NS.hex() and reply.page_bytes == LAYOUT.page_bytes
        got = await stub.GetNamespace(kvindex_pb2.GetNamespaceRequest(namespace=NS.hex()))
        assert got.layout.model_id == "test-model" and got.page_bytes == LAYOUT.page_bytes

        lease = await stub.AcquireLease(
            kvindex_pb2.AcquireLeaseRequest(
                owner_id="w1", kind=kvindex_pb2.OWNER_KIND_WORKER, node="n", address="a:1"
            )
        )
        assert lease.ttl_ms == 2000 and lease.index_run_id
        hashes = chain(6)
        ev = kvindex_pb2.BlockEvent(
            type=kvindex_pb2.BlockEvent.TYPE_STORED,
            namespace=NS.hex(),
            tier=common_pb2.TIER_DEVICE,
            block_hashes=hashes[:4],
        )
        pub = await stub.PublishEvents(
            kvindex_pb2.PublishEventsRequest(owner_id="w1", epoch=lease.epoch, seq=1, events=[ev])
        )
        assert pub.accepted and pub.expected_seq == 2
        match = await stub.MatchPrefix(
            kvindex_pb2.MatchPrefixRequest(namespace=NS.hex(), block_hashes=hashes)
        )
        assert match.longest_prefix == 4
        assert match.owners[0].tier == common_pb2.TIER_DEVICE
        assert match.owners[0].kind == kvindex_pb2.OWNER_KIND_WORKER
        # A gap asks for a snapshot; the snapshot fixes the sequence.
        gap = await stub.PublishEvents(
            kvindex_pb2.PublishEventsRequest(owner_id="w1", epoch=lease.epoch, seq=5, events=[ev])
        )
        assert not gap.accepted and gap.snapshot_required and gap.reason == "SEQUENCE_GAP"
        snap = await stub.Snapshot(
            iter(
                [
                    kvindex_pb2.SnapshotChunk(owner_id="w1", epoch=lease.epoch, seq=7),
                    kvindex_pb2.SnapshotChunk(
                        namespace=NS.hex(), tier=common_pb2.TIER_HOST, block_hashes=hashes[:2]
                    ),
                ]
            )
        )
        assert snap.blocks == 2 and snap.next_seq == 8
        assert await _owners(stub, hashes) == {"w1": 2}
        # A CLEARED with a tier clears that tier only.
        cleared = kvindex_pb2.BlockEvent(
            type=kvindex_pb2.BlockEvent.TYPE_CLEARED, tier=common_pb2.TIER_DEVICE
        )
        await stub.PublishEvents(
            kvindex_pb2.PublishEventsRequest(
                owner_id="w1", epoch=lease.epoch, seq=8, events=[cleared]
            )
        )
        assert await _owners(stub, hashes) == {"w1": 2}
        cleared.tier = common_pb2.TIER_HOST
        await stub.PublishEvents(
            kvindex_pb2.PublishEventsRequest(
                owner_id="w1", epoch=lease.epoch, seq=9, events=[cleared]
            )
        )
        assert await _owners(stub, hashes) == {}
        stats = await stub.Stats(kvindex_pb2.StatsRequest())
        assert stats.owners >= 1 and stats.index_run_id == lease.index_run_id

        bad = [
            (kvindex_pb2.MatchPrefixRequest(namespace=NS.hex(), block_hashes=[b"x" * 15]), "15"),
            (kvindex_pb2.MatchPrefixRequest(namespace="zz", block_hashes=[]), "hex digits"),
            (kvindex_pb2.MatchPrefixRequest(namespace="ab" * 16, block_hashes=[]), "not regist"),
        ]
        for req, text in bad:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.MatchPrefix(req)
            want = (
                grpc.StatusCode.NOT_FOUND if "regist" in text else grpc.StatusCode.INVALID_ARGUMENT
            )
            assert info.value.code() == want and text in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AcquireLease(kvindex_pb2.AcquireLeaseRequest(owner_id="w2"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "OWNER_KIND" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.RegisterNamespace(kvindex_pb2.RegisterNamespaceRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def _cluster_with_two_agents(kv_cluster, **extra):
    a = await kv_cluster.start_agent("a", **extra)
    b = await kv_cluster.start_agent("b", **extra)
    channel, stub = await _index_stub(kv_cluster)
    await _register(stub)
    return a, b, channel, stub


async def test_write_through_then_pull_over_grpc_and_read_in_place(kv_cluster):
    a, b, channel, stub = await _cluster_with_two_agents(kv_cluster, channels=("grpc",))
    hashes, data = chain(10, seed=1), pages(10, seed=1)
    async with channel, KVClient(b.address, kv_cluster.index.address) as producer:
        assert await producer.put(NS, hashes, data) == 10
        assert await producer.put(NS, hashes, data) == 0  # held already: nothing rewritten
        owner_b = kv_cluster.agent_app("b").owner_id
        await eventually(
            lambda: _has(stub, hashes, owner_b, 10), 5, "agent b's pages reach the index"
        )
        async with KVClient(a.address, kv_cluster.index.address) as consumer:
            plan = await consumer.plan(NS, hashes)
            assert plan.best.kind == SourceKind.REMOTE and plan.best.blocks == 10
            async with await consumer.acquire(NS, hashes) as got:
                assert len(got) == 10
                assert [v.tobytes() for v in got.views] == data
                got.verify()
            # Now local: the next acquire is served by agent a's host tier.
            owner_a = kv_cluster.agent_app("a").owner_id
            await eventually(lambda: _has(stub, hashes, owner_a, 10), 5, "agent a announces")
            async with await consumer.acquire(NS, hashes + chain(2, seed=9)) as again:
                assert again.source.kind == SourceKind.HOST and len(again) == 10
    st = kv_cluster.agent_app("a").stats()
    assert st.pages_received == 10 and st.checksum_failures == 0
    assert kv_cluster.agent_app("b").stats().pages_sent == 10


async def _has(stub, hashes, owner, n) -> bool:
    return (await _owners(stub, hashes)).get(owner) == n


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason()))
async def test_pull_over_nixl(kv_cluster):
    a, b, channel, _ = await _cluster_with_two_agents(kv_cluster)
    hashes, data = chain(8, seed=2), pages(8, seed=2)
    async with channel, KVClient(b.address) as producer, KVClient(a.address) as consumer:
        await producer.put(NS, hashes, data)
        agent = kvagent_pb2_grpc.KVAgentServiceStub(consumer._agent_channel)
        reply = await agent.PullPages(
            kvagent_pb2.PullPagesRequest(
                namespace=NS.hex(), block_hashes=hashes, source_address=b.address
            )
        )
        assert (
            reply.channel == "nixl" and reply.pulled == 8 and reply.bytes == 8 * LAYOUT.page_bytes
        )
        async with await consumer.locate(NS, hashes) as got:
            assert [v.tobytes() for v in got.views] == data


@pytest.mark.parametrize("channel", ["grpc", "nixl"])
async def test_corrupted_source_page_is_dropped_and_counted(kv_cluster, channel):
    if channel == "nixl" and nixl_unavailable_reason():
        pytest.skip(nixl_unavailable_reason())
    a, b, channel_, _ = await _cluster_with_two_agents(kv_cluster)
    hashes, data = chain(6, seed=3), pages(6, seed=3)
    async with channel_, KVClient(b.address) as producer, KVClient(a.address) as consumer:
        await producer.put(NS, hashes, data)
        # Flip one byte of page 3 in agent b's arena, behind its store's back.
        async with await producer.locate(NS, hashes) as held:
            held.views[3][100] ^= 0xFF
        agent = kvagent_pb2_grpc.KVAgentServiceStub(consumer._agent_channel)
        reply = await agent.PullPages(
            kvagent_pb2.PullPagesRequest(
                namespace=NS.hex(), block_hashes=hashes, source_address=b.address, channel=channel
            )
        )
        assert reply.channel == channel
        assert reply.pulled == 3 and reply.checksum_failures == 1
        async with await consumer.locate(NS, hashes) as got:
            assert len(got) == 3  # the bad page is not served, nor anything after it
            assert [v.tobytes() for v in got.views] == data[:3]
    stats = kv_cluster.agent_app("a").stats()
    assert stats.checksum_failures == 1


async def test_malformed_page_streams_are_rejected_and_nothing_is_lost(kv_cluster):
    a = await kv_cluster.start_agent("a", max_chunk_bytes=4096)
    channel, stub = await _index_stub(kv_cluster)
    hashes, data = chain(3, seed=4), pages(3, seed=4)
    pb = LAYOUT.page_bytes
    async with channel, open_channel(a.address) as ach:
        await _register(stub)
        agent = kvagent_pb2_grpc.KVAgentServiceStub(ach)

        def chunks(h, blob, size=4096, page_bytes=pb, checksum=None):
            checksum = page_checksum(blob) if checksum is None else checksum
            for off in range(0, len(blob), size):
                yield kvagent_pb2.PageChunk(
                    namespace=NS.hex(), block_hash=h, offset=off, data=blob[off : off + size],
                    page_bytes=page_bytes, checksum=checksum, last=off + size >= len(blob),
                )  # fmt: skip

        ok = await agent.PutPages(iter(list(chunks(hashes[0], data[0]))))
        assert ok.stored == 1 and ok.rejected == 0
        bad_sum = await agent.PutPages(iter(list(chunks(hashes[1], data[1], checksum=7))))
        assert bad_sum.stored == 0 and bad_sum.rejected == 1 and "checksum" in bad_sum.errors[0]
        cases = [
            (list(chunks(hashes[2], data[2], size=8192)), "exceeds the limit of 4096"),
            (list(chunks(hashes[2], data[2][:4096], page_bytes=4096)), "pages of 8192 bytes"),
            (list(chunks(b"short", data[2])), "block hashes are 16 bytes"),
            (list(chunks(hashes[2], data[2]))[1:], "first chunk must be at 0"),
        ]
        for stream, text in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await agent.PutPages(iter(stream))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert text in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.LocatePages(
                kvagent_pb2.LocatePagesRequest(namespace="ab" * 16, block_hashes=hashes)
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.Unpin(kvagent_pb2.UnpinRequest(pin_id="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # What was stored before the bad requests is intact.
        loc = await agent.LocatePages(
            kvagent_pb2.LocatePagesRequest(namespace=NS.hex(), block_hashes=hashes)
        )
        assert len(loc.slots) == 1
        arena = HostArena.attach(loc.shm_name)
        try:
            assert arena.view(loc.slots[0].slot).tobytes() == data[0]
        finally:
            arena.close()
        await agent.Unpin(kvagent_pb2.UnpinRequest(pin_id=loc.pin_id))
        st = await agent.Stats(kvagent_pb2.StatsRequest())
        assert st.tiers[0].pages == 1 and st.checksum_failures == 1


async def test_tensors_by_reference(kv_cluster):
    a = await kv_cluster.start_agent("a")
    arr = np.random.default_rng(5).standard_normal((64, 300)).astype(np.float32)
    raw = arr.tobytes()
    async with open_channel(a.address) as ach:
        agent = kvagent_pb2_grpc.KVAgentServiceStub(ach)
        head = kvagent_pb2.TensorChunk(
            shape=[64, 300], dtype="float32", checksum=page_checksum(raw), size_bytes=len(raw),
            ttl_ms=60_000, data=raw[:50_000], offset=0,
        )  # fmt: skip
        rest = kvagent_pb2.TensorChunk(data=raw[50_000:], offset=50_000)
        put = await agent.PutTensor(iter([head, rest]))
        assert put.ref.size_bytes == len(raw) and put.ref.node == "node-a"
        got = b"".join(
            [
                c.data
                async for c in agent.GetTensor(
                    kvagent_pb2.GetTensorRequest(ref=put.ref, chunk_bytes=10_000)
                )
            ]
        )
        assert got == raw
        gone = await agent.DeleteTensor(kvagent_pb2.DeleteTensorRequest(ref=put.ref))
        assert gone.found
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in agent.GetTensor(kvagent_pb2.GetTensorRequest(ref=put.ref)):
                pass
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        bad = kvagent_pb2.TensorChunk(shape=[2], dtype="float32", size_bytes=8, data=b"1234")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.PutTensor(iter([bad]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_ssd_tier_demotion_promotion_and_index_tiers(kv_cluster, tmp_path):
    a = await kv_cluster.start_agent(
        "a", host_bytes=4 * LAYOUT.page_bytes, ssd_path=str(tmp_path / "ssd"), ssd_bytes=1 << 20
    )
    channel, stub = await _index_stub(kv_cluster)
    hashes, data = chain(8, seed=6), pages(8, seed=6)
    async with channel, KVClient(a.address, kv_cluster.index.address) as client:
        await _register(stub)
        assert await client.put(NS, hashes[:4], data[:4]) == 4
        assert await client.put(NS, hashes[4:], data[4:]) == 4  # demotes the first four
        owner = kv_cluster.agent_app("a").owner_id

        async def tiers() -> bool:
            reply = await stub.MatchPrefix(
                kvindex_pb2.MatchPrefixRequest(namespace=NS.hex(), block_hashes=hashes)
            )
            return any(o.owner_id == owner and o.matched_blocks == 8 for o in reply.owners)

        await eventually(tiers, 5, "host and ssd pages announced")
        plan = await client.plan(NS, hashes)
        assert plan.best.kind == SourceKind.SSD  # the slowest tier of the run
        async with await client.acquire(NS, hashes[:4]) as got:
            assert [v.tobytes() for v in got.views] == data[:4]
        st = kv_cluster.agent_app("a").stats()
        # Promoting the first four demoted the others; SSD keeps a copy of every page.
        assert st.tiers[1].pages == 8 and st.tiers[1].hits == 4 and st.tiers[0].pages == 4


async def test_agent_connector_serves_the_engine_protocol(kv_cluster):
    from omniflow_services.worker.llm.connector import AgentConnector, KVConnector

    a = await kv_cluster.start_agent("a")
    b = await kv_cluster.start_agent("b")
    hashes, data = chain(6, seed=8), pages(6, seed=8)
    # The engine calls the connector from its own thread: so do we (the servers run here).
    writer = await asyncio.to_thread(AgentConnector, b.address, kv_cluster.index.address)
    reader = await asyncio.to_thread(AgentConnector, a.address, kv_cluster.index.address)
    try:
        assert isinstance(writer, KVConnector)
        await asyncio.to_thread(writer.store_pages, LAYOUT, hashes[:4], data[:4])
        await asyncio.to_thread(writer.flush)
        owner_b = kv_cluster.agent_app("b").owner_id
        channel, stub = await _index_stub(kv_cluster)
        async with channel:
            await eventually(lambda: _has(stub, hashes, owner_b, 4), 5, "b announces")
        got = await asyncio.to_thread(reader.fetch_pages, LAYOUT, hashes)
        assert got == data[:4]  # the leading run; the rest is the engine's to compute
    finally:
        await asyncio.to_thread(writer.close)
        await asyncio.to_thread(reader.close)
