"""The diffusion role pulls the prompt pages an LLM engine on another node produced, through
the agents (index match, agent-to-agent pull, in-place read), instead of recomputing them;
its image equals the one made with the prompt recomputed at every step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mm_cluster import Cluster

from omniflow.chat import Preprocessor
from omniflow.kv.blocks import block_hashes
from omniflow.kv.client import KVClient, SourceKind
from omniflow.localredis import start_redis
from omniflow.models.resolve import resolve_model
from omniflow.models.tiny_mm import make_image_head
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from omniflow_services.worker.mm.diffusion import flow_euler, initial_noise
from omniflow_services.worker.mm.image_role import ImageRequest
from omniflow_services.worker.mm.loading import load_roles


@pytest.fixture
def agents(tmp_path: Path, redis_binary: Path) -> Iterator[Cluster]:
    redis = start_redis(dir=tmp_path / "redis", binary=redis_binary)
    c = Cluster(tmp_path, redis, tmp_path / "models")
    try:
        c.start("kv_index", "kv-index")
        index = c.wait("kv-index")
        for node in ("a", "b"):
            c.start("kv_agent", f"agent-{node}", OMNIFLOW_KV_INDEX_ADDR=index,
                    OMNIFLOW_NODE_ID=f"node-{node}",
                    OMNIFLOW_KV_HOST_BYTES=str(16 * 1024 * 1024),
                    OMNIFLOW_KV_SSD_PATH=str(tmp_path / f"ssd-{node}.bin"),
                    OMNIFLOW_KV_SSD_BYTES=str(4 * 1024 * 1024))  # fmt: skip
        c.wait("agent-a")
        c.wait("agent-b")
        yield c
    finally:
        c.stop()
        redis.stop()


async def test_diffusion_pulls_the_llm_prompt_pages_through_the_agents(
    agents: Cluster, tmp_path: Path
) -> None:
    from omniflow_services.worker.llm.connector import AgentConnector

    models = tmp_path / "models"
    backbone = resolve_model("tiny:qwen2", models)
    head = make_image_head(tmp_path / "head", backbone="tiny:qwen2")
    index = agents.addresses["kv-index"]
    conn_a = await asyncio.to_thread(AgentConnector, agents.addresses["agent-a"], index)
    conn_b = await asyncio.to_thread(AgentConnector, agents.addresses["agent-b"], index)
    try:
        # The LLM worker on node a prefills the prompt; its full pages go through to agent a.
        llm = await asyncio.to_thread(
            Engine, backbone, EngineConfig(num_pages=64), connector=conn_a
        )
        prep = Preprocessor.from_folder(backbone, llm.layout.namespace, tokenizer=llm.tokenizer)
        ids = prep.encode_chat([{"role": "user", "content": "a castle " * 12}])
        assert len(ids) > 48
        async for _ in llm.generate(
            GenerateRequest("pre", prompt_token_ids=ids, params=SamplingParams(1, 0.0))
        ):
            pass
        await asyncio.to_thread(conn_a.flush)
        ns = llm.layout.namespace
        hashes = block_hashes(ns, ids, 16)
        async with KVClient(agents.addresses["agent-b"], index) as probe:
            for _ in range(100):  # agent a announces its pages to the index
                plan = await probe.plan(ns, hashes)
                if plan.best.blocks == len(hashes):
                    break
                await asyncio.sleep(0.05)
            assert plan.best.kind == SourceKind.REMOTE and plan.best.blocks == len(hashes)

        # The diffusion worker on node b: same backbone, its own engine, agent b's connector.
        roles = await load_roles(
            "diffusion", str(head), models, EngineConfig(num_pages=64), connector=conn_b
        )
        role = roles.diffusion
        assert role is not None and role.engine.layout.namespace == ns
        neg = prep.encode_chat([{"role": "user", "content": ""}])
        req = ImageRequest("img", ids, neg, 32, 32, steps=3, guidance=2.0, seed=2)
        result = await role.generate(req)
        full = len(ids) // 16 * 16
        want = full if full < len(ids) else full - 16  # one token is always computed
        assert result.cached_prompt_tokens == want
        assert role.engine.stats.connector_hit_tokens == want
        h = role.head
        ref = flow_euler(
            lambda x, t: h.velocity_recompute(x, t, ids),
            lambda x, t: h.velocity_recompute(x, t, neg),
            initial_noise(h.latent_shape(32, 32), 2),
            3,
            2.0,
        )
        torch.testing.assert_close(result.latents, ref, atol=1e-4, rtol=0)
    finally:
        await asyncio.to_thread(conn_a.close)
        await asyncio.to_thread(conn_b.close)


async def test_second_turn_on_another_worker_reuses_the_image_pages(
    agents: Cluster, tmp_path: Path
) -> None:
    """Turn 1 on node a, turn 2 on node b: the pages through the image span are pulled, the
    image is not encoded again, and the logits equal a full recompute."""
    from omniflow.kv.blocks import MultimodalSpan, apply_multimodal, item_id, pad_id
    from omniflow_services.worker.engine import EmbedSpan
    from omniflow_services.worker.llm.connector import AgentConnector

    backbone = resolve_model("tiny:qwen2", tmp_path / "models")
    index = agents.addresses["kv-index"]
    conn_a = await asyncio.to_thread(AgentConnector, agents.addresses["agent-a"], index)
    conn_b = await asyncio.to_thread(AgentConnector, agents.addresses["agent-b"], index)
    emb = 0.3 * torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    image = b"the image's bytes"
    calls: list[str] = []

    def request(rid: str, suffix: list[int]) -> GenerateRequest:
        prefix = [5, 6, 7, 8]
        toks = [*prefix, *([pad_id(item_id(image))] * 40), *suffix]
        toks, extra = apply_multimodal(toks, [MultimodalSpan(item_id(image), 4, 40)], 16)

        def load() -> torch.Tensor:
            calls.append(rid)
            return emb

        return GenerateRequest(
            rid, prompt_token_ids=toks, params=SamplingParams(3, 0.0, ignore_eos=True),
            extra_keys=extra, embeds=(EmbedSpan(4, 40, load),), return_logits=True,
        )  # fmt: skip

    async def run(engine: Engine, req: GenerateRequest) -> tuple[torch.Tensor, int]:
        outs = [o async for o in engine.generate(req)]
        return torch.cat([o.logits for o in outs if o.logits is not None]), outs[
            -1
        ].usage.cached_tokens

    try:
        a = await asyncio.to_thread(Engine, backbone, EngineConfig(num_pages=64), connector=conn_a)
        await run(a, request("t1", [9, 10, 11, 12, 13, 14]))
        await asyncio.to_thread(conn_a.flush)
        b = await asyncio.to_thread(Engine, backbone, EngineConfig(num_pages=64), connector=conn_b)
        turn2 = request("t2", [9, 10, 11, 12, 13, 14, 15, 16, 17])
        hashes = block_hashes(a.layout.namespace, turn2.prompt_token_ids, 16, turn2.extra_keys)
        async with KVClient(agents.addresses["agent-b"], index) as probe:
            for _ in range(100):
                if (await probe.plan(a.layout.namespace, hashes[:3])).best.blocks == 3:
                    break
                await asyncio.sleep(0.05)
        logits, cached = await run(b, turn2)
        assert cached == 48  # pages 0-2 (the image spans 4..43) pulled from agent a
        assert calls == ["t1"]  # node b never needed the embeddings
        fresh = await asyncio.to_thread(
            Engine, backbone, EngineConfig(num_pages=64, enable_prefix_cache=False)
        )
        ref, _ = await run(fresh, request("r", [9, 10, 11, 12, 13, 14, 15, 16, 17]))
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    finally:
        await asyncio.to_thread(conn_a.close)
        await asyncio.to_thread(conn_b.close)
