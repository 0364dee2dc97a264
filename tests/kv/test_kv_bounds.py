"""Bounded inputs on the Data Flow edges, in-process on a real Redis: hashes per request,
owners and namespaces at the index; arenas and namespaces per agent, pin and reservation
TTLs capped by the agent; an undecodable message is INVALID_ARGUMENT (logged once per
client per minute), and the service still answers a good request. Each error names the
limit's setting."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import grpc
import pytest
from kv_helpers import LAYOUT

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.config import load_settings
from omniflow.kv.blocks import KVLayout
from omniflow.kv.wire import layout_to_proto
from omniflow.rpc.client import open_channel
from omniflow.rpc.server import ServiceHost
from omniflow_services.kv_index.config import KVIndexSettings
from omniflow_services.kv_index.server import KVIndexApp

OTHER = KVLayout("test-model-b", num_layers=1, num_kv_heads=1, head_dim=16, page_size=16)


async def _register(stub, layout: KVLayout = LAYOUT) -> None:
    await stub.RegisterNamespace(
        kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(layout))
    )


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


@pytest.fixture
async def small_index(redis_server):
    """An index of its own with tiny limits (the session Redis, a key prefix of its own)."""
    tag = uuid.uuid4().hex[:8]
    settings = dataclasses.replace(
        load_settings(KVIndexSettings, env={}),
        redis_url=redis_server.url,
        port=0,
        metrics_port=-1,
        instance_id=f"kvi-bounds-{tag}",
        key_prefix=f"tb:{tag}:",
        max_hashes=8,
        max_owners=1,
        max_index_namespaces=1,
    )
    host = ServiceHost(KVIndexApp(settings), settings)
    await host.start()
    try:
        yield host
    finally:
        await host.stop()


async def test_index_bounds_name_their_settings(small_index) -> None:
    async with open_channel(small_index.address) as channel:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        await _register(stub)
        await _register(stub)  # the same namespace again: still fine at the limit
        code, msg = await _code(stub.RegisterNamespace(
            kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(OTHER))))  # fmt: skip
        assert (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED and "OMNIFLOW_KV_MAX_INDEX_NAMESPACES" in msg
        )

        code, msg = await _code(stub.MatchPrefix(kvindex_pb2.MatchPrefixRequest(
            namespace=LAYOUT.namespace.hex(), block_hashes=[b"\x01" * 16] * 9)))  # fmt: skip
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "9" in msg and "limit is 8" in msg and "OMNIFLOW_KV_MAX_HASHES" in msg
        ok = await stub.MatchPrefix(kvindex_pb2.MatchPrefixRequest(
            namespace=LAYOUT.namespace.hex(), block_hashes=[b"\x01" * 16] * 8))  # fmt: skip
        assert ok.longest_prefix == 0

        def lease(owner: str) -> kvindex_pb2.AcquireLeaseRequest:
            return kvindex_pb2.AcquireLeaseRequest(
                owner_id=owner, node="n", address="127.0.0.1:1",
                kind=kvindex_pb2.OWNER_KIND_WORKER,
            )  # fmt: skip

        first = await stub.AcquireLease(lease("owner-a"))
        code, msg = await _code(stub.AcquireLease(lease("owner-b")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "OMNIFLOW_KV_MAX_OWNERS" in msg
        events = kvindex_pb2.PublishEventsRequest(
            owner_id="owner-a", epoch=first.epoch, seq=1,
            events=[kvindex_pb2.BlockEvent(
                type=kvindex_pb2.BlockEvent.TYPE_STORED, namespace=LAYOUT.namespace.hex(),
                block_hashes=[b"\x02" * 16] * 5) for _ in range(2)],
        )  # fmt: skip
        code, msg = await _code(stub.PublishEvents(events))  # 10 hashes in one batch
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "OMNIFLOW_KV_MAX_HASHES" in msg


async def test_undecodable_request_is_invalid_argument_logged_once(small_index, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="omniflow.rpc.interceptors")
    async with open_channel(small_index.address) as channel:
        raw = channel.unary_unary(
            "/omniflow.api.kvindex.v1.KVIndexService/MatchPrefix",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        for junk in (b"\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\xff\xff"):
            code, msg = await _code(raw(junk))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
            assert "not a valid protobuf message" in msg
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        await stub.Stats(kvindex_pb2.StatsRequest())  # still answers
    logged = [r for r in caplog.records if "undecodable request" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a client's mistake"


async def test_agent_bounds_arenas_namespaces_and_ttl_caps(kv_cluster) -> None:
    agent = await kv_cluster.start_agent(
        "bounded", max_arenas=1, max_namespaces=2, max_pin_ttl_ms=1000,
        max_reservation_ttl_ms=1000,
    )  # fmt: skip
    third = KVLayout("test-model-c", num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)
    async with open_channel(kv_cluster.index.address) as ich, open_channel(agent.address) as ach:
        index = kvindex_pb2_grpc.KVIndexServiceStub(ich)
        for layout in (LAYOUT, OTHER, third):
            await _register(index, layout)
        stub = kvagent_pb2_grpc.KVAgentServiceStub(ach)
        await stub.GetArena(kvagent_pb2.GetArenaRequest(namespace=LAYOUT.namespace.hex()))
        # Another page size would be another whole arena.
        code, msg = await _code(
            stub.GetArena(kvagent_pb2.GetArenaRequest(namespace=OTHER.namespace.hex()))
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "OMNIFLOW_KV_MAX_ARENAS" in msg
        # Same page size as LAYOUT: same arena, one namespace more (2 of 2).
        assert third.page_bytes == LAYOUT.page_bytes
        await stub.GetArena(kvagent_pb2.GetArenaRequest(namespace=third.namespace.hex()))
        fourth = KVLayout("test-model-d", num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)
        await _register(index, fourth)
        code, msg = await _code(
            stub.GetArena(kvagent_pb2.GetArenaRequest(namespace=fourth.namespace.hex()))
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "OMNIFLOW_KV_MAX_NAMESPACES" in msg

        # TTLs a client asks for are cut to the agent's caps.
        ns = LAYOUT.namespace.hex()
        reply = await stub.CommitPages(kvagent_pb2.CommitPagesRequest(
            namespace=ns, reserve=1, reservation_ttl_ms=49 * 24 * 3600 * 1000))  # fmt: skip
        pools = kv_cluster.agent_app("bounded").pools
        deadlines = list(pools._reserved.values())
        assert reply.reserved_slots and deadlines
        assert max(deadlines) <= time.monotonic() + 1.0 + 0.5


async def test_two_topologies_do_not_share_shared_memory(kv_cluster, tmp_path) -> None:
    from omniflow.cli.local import run_tag
    from omniflow.kv.arena import arena_path

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tags = run_tag(tmp_path / "a"), run_tag(tmp_path / "b")
    assert tags[0] != tags[1] and run_tag(tmp_path / "a") == tags[0]  # stable per folder
    # Same instance id ("kv-agent" in both topologies), different run folders.
    first = await kv_cluster.start_agent("twin", shm_tag=tags[0])
    second = await kv_cluster.start_agent("twin", shm_tag=tags[1])
    async with open_channel(kv_cluster.index.address) as ich:
        await _register(kvindex_pb2_grpc.KVIndexServiceStub(ich))
    names = []
    for host in (first, second):
        async with open_channel(host.address) as channel:
            stub = kvagent_pb2_grpc.KVAgentServiceStub(channel)
            reply = await stub.GetArena(
                kvagent_pb2.GetArenaRequest(namespace=LAYOUT.namespace.hex())
            )
            names.append(reply.shm_name)
    assert names[0] != names[1] and tags[0] in names[0] and tags[1] in names[1]
    # Both arenas exist side by side: the second agent did not replace the first's.
    assert all(arena_path(n).exists() for n in names)
    inodes = {arena_path(n).stat().st_ino for n in names}
    assert len(inodes) == 2
