"""The namespace on the wire: ``namespace_id`` (16 bytes) is read first, the deprecated hex
``namespace`` string only when it is empty, so an old client's requests keep working; both
are written for one release. Real kv-index and kv-agent servers on port 0, a real Redis."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from kv_helpers import LAYOUT, chain, pages

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.api.router.v1 import router_pb2
from omniflow.api.worker.v1 import worker_pb2
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout
from omniflow.kv.checksum import page_checksum
from omniflow.kv.client import KVClient
from omniflow.kv.pages import page_chunks
from omniflow.kv.wire import layout_to_proto, namespace_fields, read_namespace
from omniflow.rpc.client import open_channel

NS = LAYOUT.namespace
OTHER = KVLayout("another-model", 2, 2, 16, page_size=16).namespace


def test_read_prefers_bytes_and_falls_back_to_the_old_string() -> None:
    assert read_namespace(kvindex_pb2.MatchPrefixRequest(namespace_id=NS)) == NS
    assert read_namespace(kvindex_pb2.MatchPrefixRequest(namespace=NS.hex())) == NS  # old client
    both = kvindex_pb2.MatchPrefixRequest(namespace_id=NS, namespace=OTHER.hex())
    assert read_namespace(both) == NS
    pick = router_pb2.PickRequest(kv_namespace=NS.hex())
    assert read_namespace(pick, "kv_namespace") == NS
    assert read_namespace(router_pb2.PickRequest(), "kv_namespace", optional=True) == b""
    pages_msg = worker_pb2.PromptPages(**namespace_fields(NS, "kv_namespace"))
    assert (pages_msg.kv_namespace_id, pages_msg.kv_namespace) == (NS, NS.hex())
    with pytest.raises(InvalidArgument, match="namespace_id must be 16 bytes"):
        read_namespace(kvindex_pb2.MatchPrefixRequest(namespace_id=b"short"))
    with pytest.raises(InvalidArgument, match="32 hex digits"):
        read_namespace(kvindex_pb2.MatchPrefixRequest(namespace="not hex"))
    with pytest.raises(InvalidArgument, match="32 hex digits"):
        read_namespace(kvindex_pb2.MatchPrefixRequest())  # none: required


def test_page_stream_carries_both_on_first_chunks_only() -> None:
    hashes, data = chain(2, seed=9), pages(2, seed=9)
    chunks = list(page_chunks(NS, hashes, data, LAYOUT.page_bytes // 2))
    firsts = [c for c in chunks if c.offset == 0]
    assert len(firsts) == 2 and all(
        c.namespace_id == NS and c.namespace == NS.hex() for c in firsts
    )
    assert all(not c.namespace_id and not c.namespace for c in chunks if c.offset)


async def test_old_and_new_clients_against_real_servers(kv_cluster) -> None:
    a = await kv_cluster.start_agent("a")
    hashes, data = chain(3, seed=21), pages(3, seed=21)
    async with open_channel(kv_cluster.index.address) as ich, open_channel(a.address) as ach:
        index = kvindex_pb2_grpc.KVIndexServiceStub(ich)
        agent = kvagent_pb2_grpc.KVAgentServiceStub(ach)
        reg = await index.RegisterNamespace(
            kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(LAYOUT))
        )
        assert reg.namespace_id == NS and reg.namespace == NS.hex()  # both, for one release

        # An old client: every request names the namespace by the hex string alone.
        got = await index.GetNamespace(kvindex_pb2.GetNamespaceRequest(namespace=NS.hex()))
        assert got.page_bytes == LAYOUT.page_bytes
        old_chunks = [
            kvagent_pb2.PageChunk(
                namespace=NS.hex(), block_hash=h, offset=0, data=blob,
                page_bytes=len(blob), checksum=page_checksum(blob), last=True,
            )
            for h, blob in zip(hashes[:2], data[:2], strict=True)
        ]  # fmt: skip
        put = await agent.PutPages(iter(old_chunks))
        assert (put.stored, put.rejected) == (2, 0), put.errors
        streamed = [
            c
            async for c in agent.GetPages(
                kvagent_pb2.GetPagesRequest(namespace=NS.hex(), block_hashes=hashes[:2])
            )
        ]
        assert b"".join(c.data for c in streamed) == data[0] + data[1]
        assert streamed[0].namespace == NS.hex()  # what an old client reads is still there

        # A new client (the library): bytes only on what it reads; the index sees the pages.
        # In place (CommitPages, LocatePages) and streamed (PutPages, GetPages).
        in_place = KVClient(a.address, kv_cluster.index.address)
        streamed_client = KVClient(a.address, kv_cluster.index.address, zero_copy=False)
        try:
            assert await in_place.ensure_namespace(LAYOUT) == NS
            assert await in_place.put(NS, hashes, data) == 1  # two were held already
            assert [p.tobytes() for p in await in_place.read(NS, hashes)] == data
            assert await streamed_client.write(NS, hashes, data) == 3
            assert streamed_client.stats.streamed_puts == 3  # over PutPages, bytes field only
            assert [p.tobytes() for p in await streamed_client.read(NS, hashes)] == data
            assert streamed_client.stats.streamed_gets == 3
        finally:
            await in_place.close()
            await streamed_client.close()

        async def matched(req: kvindex_pb2.MatchPrefixRequest) -> int:
            # The agent announces its pages to the index in the background: wait for them.
            end = time.monotonic() + 10.0
            while True:
                got = (await index.MatchPrefix(req)).longest_prefix
                if got == len(hashes) or time.monotonic() > end:
                    return got
                await asyncio.sleep(0.05)

        new = kvindex_pb2.MatchPrefixRequest(namespace_id=NS, block_hashes=hashes)
        old = kvindex_pb2.MatchPrefixRequest(namespace=NS.hex(), block_hashes=hashes)
        assert await matched(new) == await matched(old) == 3
        # The bytes field wins over a stale string.
        mixed = await index.MatchPrefix(
            kvindex_pb2.MatchPrefixRequest(
                namespace_id=NS, namespace=OTHER.hex(), block_hashes=hashes
            )
        )
        assert mixed.longest_prefix == 3

        # Malformed bytes are the caller's error, named.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await index.MatchPrefix(
                kvindex_pb2.MatchPrefixRequest(namespace_id=b"x" * 5, block_hashes=hashes)
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "namespace_id must be 16 bytes" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.LocatePages(
                kvagent_pb2.LocatePagesRequest(namespace_id=b"x" * 17, block_hashes=hashes)
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # One PutPages stream, one namespace, whichever field names it.
        mixed_stream = [
            kvagent_pb2.PageChunk(
                namespace_id=ns, block_hash=h, offset=0, data=blob,
                page_bytes=len(blob), checksum=page_checksum(blob), last=True,
            )
            for ns, h, blob in ((NS, hashes[0], data[0]), (OTHER, hashes[1], data[1]))
        ]  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.PutPages(iter(mixed_stream))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "one namespace" in info.value.details()
