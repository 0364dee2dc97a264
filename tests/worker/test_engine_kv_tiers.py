"""Engine parity with transformers when the prompt's KV comes from the Data Flow layer:
restored from the node's host tier, and pulled from a remote node's agent. Real kv-index
and kv-agents (in-process gRPC servers on port 0) and a real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_helpers import TinyModel, greedy, run_all

from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.kv.blocks import block_hashes
from omniflow.rpc.client import open_channel
from omniflow_services.worker.llm.connector import AgentConnector


async def _announced(index_address: str, namespace: bytes, hashes: list[bytes]) -> int:
    async with open_channel(index_address) as channel:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        reply = await stub.MatchPrefix(
            kvindex_pb2.MatchPrefixRequest(namespace=namespace.hex(), block_hashes=hashes)
        )
    return reply.longest_prefix


async def _produce(tiny: TinyModel, agent: str, index: str, prompt: list[int]) -> list[bytes]:
    """Run ``prompt`` on an engine attached to ``agent``; wait until the index has its pages."""
    connector = await asyncio.to_thread(AgentConnector, agent, index)
    try:
        engine = tiny.engine(connector=connector)
        await asyncio.to_thread(run_all, engine, [greedy("p", prompt, 2, logits=False)])
        await asyncio.to_thread(connector.flush)
        hashes = block_hashes(engine.layout.namespace, prompt, engine.layout.page_size)
        end = time.monotonic() + 10
        while await _announced(index, engine.layout.namespace, hashes) < len(hashes):
            assert time.monotonic() < end, "pages never announced by the agent"
            await asyncio.sleep(0.05)
        return hashes
    finally:
        await asyncio.to_thread(connector.close)


@pytest.mark.integration
@pytest.mark.parametrize("where", ["host tier, same node", "remote agent"])
async def test_prefix_from_the_data_plane_matches_transformers(kv_cluster, tiny, where):
    a = await kv_cluster.start_agent("a")
    b = await kv_cluster.start_agent("b")
    index = kv_cluster.index.address
    prompt = tiny.prompt(70, seed=11)
    hashes = await _produce(tiny, a.address, index, prompt)
    assert len(hashes) == 4

    consumer_agent = a if where == "host tier, same node" else b
    connector = await asyncio.to_thread(AgentConnector, consumer_agent.address, index)
    try:
        engine = tiny.engine(connector=connector)  # a fresh device pool: nothing cached
        res = (await asyncio.to_thread(run_all, engine, [greedy("c", prompt, 8)]))["c"]
    finally:
        await asyncio.to_thread(connector.close)
    assert res.final.usage.cached_tokens == 64  # four full pages from the data plane
    assert engine.stats.connector_hit_tokens == 64 and engine.stats.connector_failures == 0
    if where == "remote agent":
        assert kv_cluster.agent_app("b").stats().pages_received >= 4
    await asyncio.to_thread(tiny.check, prompt, res)
