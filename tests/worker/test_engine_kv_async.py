"""Asynchronous KV loading: while one request pulls a long prefix from another node's agent,
the rest of the batch keeps producing tokens; the pulled prefix then serves the request
with transformers' outputs. Real kv-index and kv-agents (in-process gRPC on port 0), Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from engine_helpers import Result, TinyModel, greedy, run_all

from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.kv.blocks import block_hashes
from omniflow.rpc.client import open_channel
from omniflow_services.worker.llm.connector import AgentConnector

PREFIX = 1000  # tokens: 62 full pages pulled from the other node


async def _publish(tiny: TinyModel, agent: str, index: str, prompt: list[int]) -> None:
    """Compute ``prompt`` on node a's engine; wait until the index lists all its pages."""
    connector = await asyncio.to_thread(AgentConnector, agent, index)
    try:
        engine = tiny.engine(connector=connector)
        await asyncio.to_thread(run_all, engine, [greedy("p", prompt, 1, logits=False)])
        await asyncio.to_thread(connector.flush)
        hashes = block_hashes(engine.layout.namespace, prompt, engine.layout.page_size)
        end = time.monotonic() + 20
        async with open_channel(index) as channel:
            stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
            while True:
                reply = await stub.MatchPrefix(
                    kvindex_pb2.MatchPrefixRequest(
                        namespace=engine.layout.namespace.hex(), block_hashes=hashes
                    ),
                    timeout=5,
                )
                if reply.longest_prefix >= len(hashes):
                    return
                assert time.monotonic() < end, "pages never announced by node a's agent"
                await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(connector.close)


def _step_through_the_pull(engine, tiny: TinyModel, prompt: list[int]):  # type: ignore[no-untyped-def]
    """Two requests decode; the long-prefix one arrives; step until it is done.

    Returns, per step that ended with the pull still in flight, the tokens the two others
    got in it, and the long request's outputs."""
    others = [greedy(f"o{i}", tiny.prompt(12, seed=200 + i), 400, logits=False) for i in (1, 2)]
    for r in others:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    engine.add_request(greedy("long", prompt, 6))
    during: list[dict[str, int]] = []
    long_outs = []
    for _ in range(10_000):
        got = {"o1": 0, "o2": 0}
        for o in engine.step():
            if o.request_id == "long":
                long_outs.append(o)
            else:
                got[o.request_id] += len(o.new_token_ids)
        if engine.load().waiting and not long_outs and engine.stats.async_loads:
            during.append(got)
        if long_outs and long_outs[-1].finished:
            break
    for r in others:
        engine.abort(r.request_id)
    engine.step()
    return during, long_outs


@pytest.mark.integration
async def test_the_batch_keeps_stepping_while_a_prefix_is_pulled(kv_cluster, tiny_factory):
    tiny = tiny_factory("llama", max_position=2048)
    a = await kv_cluster.start_agent("a", host_bytes=16 * 1024 * 1024)
    b = await kv_cluster.start_agent("b", host_bytes=16 * 1024 * 1024)
    index = kv_cluster.index.address
    prompt = tiny.prompt(PREFIX + 8, seed=77)
    await _publish(tiny, a.address, index, prompt)

    connector = await asyncio.to_thread(AgentConnector, b.address, index)
    try:
        engine = tiny.engine(connector=connector, num_pages=256)
        during, outs = await asyncio.to_thread(_step_through_the_pull, engine, tiny, prompt)
    finally:
        await asyncio.to_thread(connector.close)

    assert engine.stats.async_loads == 1 and engine.stats.connector_failures == 0
    # Steps ran while the pull was in flight, and each gave both decoding requests a token.
    assert during, "no step ran while the prefix was being pulled"
    assert all(g == {"o1": 1, "o2": 1} for g in during), during
    print(f"{len(during)} steps ran during the pull")
    assert kv_cluster.agent_app("b").stats().pages_received >= PREFIX // 16
    final = outs[-1]
    assert final.usage.cached_tokens == PREFIX // 16 * 16
    tokens = [t for o in outs for t in o.new_token_ids]
    logits = torch.cat([o.logits for o in outs if o.logits is not None])
    await asyncio.to_thread(tiny.check, prompt, Result(tokens, logits, outs))


def test_a_connector_assigned_after_construction_serves_prefixes(tiny: TinyModel) -> None:
    """A worker attaches its kv-agent after the engine exists (``engine.connector = ...``)."""
    from omniflow_services.worker.engine import MemoryConnector

    store = MemoryConnector()
    prompt = tiny.prompt(70, seed=78)
    run_all(tiny.engine(connector=store), [greedy("p", prompt, 1, logits=False)])
    engine = tiny.engine()
    engine.connector = store
    res = run_all(engine, [greedy("c", prompt, 5)])["c"]
    assert res.final.usage.cached_tokens == 64 and engine.stats.async_loads == 1
    tiny.check(prompt, res)
