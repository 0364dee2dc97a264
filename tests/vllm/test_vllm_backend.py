"""The vLLM backend (``OMNIFLOW_WORKER_ENGINE=vllm``) through the worker's gRPC API, on CPU.

Real processes: Redis, a kv-index, a kv-agent on each of two nodes and a vLLM worker on
each node, run from vLLM's virtualenv. References: vLLM alone (``LLM.generate`` in the
same virtualenv, as a subprocess) for the outputs.

- greedy outputs through Generate equal vLLM alone;
- a worker on the other node answers a shared-prefix prompt with the prefix loaded from
  the first node's agent through its own (cached tokens reported), output unchanged;
- the agent that holds a prefix is SIGKILLed after the index named it and before the
  second node pulls it: the load fails, vLLM recomputes, the output is still right.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from vllm_cluster import BLOCK, LEASE_MS, VLLMCluster, metric, run_vllm_alone

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.kv.blocking import AgentPageStore
from omniflow.rpc.client import open_channel
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

MAX_TOKENS = 24
VOCAB = 49152


def tokens(n: int, seed: int) -> list[int]:
    # Ordinary (non-special) token ids of SmolLM2's vocabulary.
    return np.random.default_rng(seed).integers(1000, 40000, n).tolist()


PREFIX = tokens(200, 1)  # 12 full pages of 16 tokens; 6 vLLM CPU blocks of 32
PREFIX_KILL = tokens(160, 2)
PROMPTS = {
    "short": tokens(12, 3),
    "odd": tokens(45, 4),
    "shared-a": PREFIX + tokens(9, 5),
    "shared-b": PREFIX + tokens(7, 6),
    "kill-a": PREFIX_KILL + tokens(5, 7),
    "kill-b": PREFIX_KILL + tokens(11, 8),
}


async def generate(
    address: str, ids: list[int], rid: str, top_logprobs: int = -1
) -> worker_pb2.GenerateResponse:
    """One greedy Generate (with logprobs when ``top_logprobs`` >= 0); the last reply with
    every streamed token id, text and logprob gathered in it."""
    out: list[int] = []
    text: list[str] = []
    lps: list[float] = []
    tops: list[worker_pb2.TopLogprobs] = []
    last = None
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    if top_logprobs >= 0:
        sampling.logprobs, sampling.top_logprobs = True, top_logprobs
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb2.GenerateRequest(
            request_id=rid, token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling
        )
        async for reply in stub.Generate(request, timeout=300):
            out.extend(reply.token_ids)
            text.append(reply.text)
            lps.extend(reply.logprobs)
            tops.extend(reply.top_logprobs)
            last = reply
    assert last is not None and last.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED
    del last.token_ids[:], last.logprobs[:], last.top_logprobs[:]
    last.token_ids.extend(out)
    last.logprobs.extend(lps)
    last.top_logprobs.extend(tops)
    last.text = "".join(text)
    return last


async def indexed(index: str, namespace: str, hashes: list[bytes], owner_prefix: str) -> int:
    """Leading ``hashes`` the index names an owner starting with ``owner_prefix`` for."""
    async with open_channel(index) as channel:
        reply = await kvindex_pb2_grpc.KVIndexServiceStub(channel).MatchPrefix(
            kvindex_pb2.MatchPrefixRequest(namespace=namespace, block_hashes=hashes), timeout=5
        )
    return max(
        (o.matched_blocks for o in reply.owners if o.owner_id.startswith(owner_prefix)),
        default=0,
    )


async def wait_indexed(index: str, ns: str, hashes: list[bytes], owner: str, n: int) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if await indexed(index, ns, hashes, owner) >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{owner} does not hold {n} pages in the index after 30s")


async def worker_namespace(address: str) -> str:
    async with open_channel(address) as channel:
        info = await worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(
            worker_pb2.GetInfoRequest(), timeout=5
        )
    return info.info.kv_namespace


@pytest.fixture(scope="module")
def reference_full(vllm_cluster: VLLMCluster) -> dict[str, dict]:
    """vLLM alone, before any worker starts (the machine has two cores)."""
    names = list(PROMPTS)
    # kill-b is recomputed whole by the worker (its prefix cannot be loaded).
    fresh = [n == "kill-b" for n in names]
    out = run_vllm_alone(
        vllm_cluster.model, [PROMPTS[n] for n in names], MAX_TOKENS, vllm_cluster.tmp, fresh
    )
    return dict(zip(names, out, strict=True))


@pytest.fixture(scope="module")
def reference(reference_full) -> dict[str, list[int]]:
    return {name: r["ids"] for name, r in reference_full.items()}


@pytest.fixture(scope="module")
def nodes(vllm_cluster: VLLMCluster, reference) -> dict[str, str]:
    c = vllm_cluster
    index = c.start(
        "kv_index", "kv-index", OMNIFLOW_KV_LEASE_TTL_MS=str(LEASE_MS),
        OMNIFLOW_KV_KEY_PREFIX=f"t:{c.tag}:",
    ).wait_ready()  # fmt: skip
    agents = {}
    for node in ("node-a", "node-b"):
        agents[node] = c.agent(node)
    for proc in agents.values():
        proc.wait_ready()
    workers = {node: c.vllm_worker(f"vllm-{node}", node, agents[node].address) for node in agents}
    for proc in workers.values():
        proc.wait_ready(timeout_s=600)  # vLLM on a busy 2-core machine starts slowly
    return {
        "index": index.address,
        **{f"agent-{n}": p.address for n, p in agents.items()},
        **{f"worker-{n}": p.address for n, p in workers.items()},
    }


async def test_greedy_outputs_equal_vllm_alone(nodes, reference, reference_full) -> None:
    for name in ("short", "odd"):
        reply = await generate(nodes["worker-node-a"], PROMPTS[name], f"eq-{name}", 3)
        assert list(reply.token_ids) == reference[name], name
        want = reference_full[name]
        assert list(reply.logprobs) == pytest.approx(want["logprobs"], abs=1e-4), name
        assert [list(t.token_ids) for t in reply.top_logprobs] == want["top"], name
        assert all(len(t.logprobs) == 3 for t in reply.top_logprobs)
        assert reply.usage.prompt_tokens == len(PROMPTS[name])
        assert reply.usage.completion_tokens == len(reference[name])
        assert reply.text  # detokenized by vLLM
        assert len(reply.prompt_block_hashes) == len(PROMPTS[name]) // 16


async def test_second_node_loads_a_shared_prefix_through_the_agents(
    nodes, reference, vllm_cluster
) -> None:
    a, b = nodes["worker-node-a"], nodes["worker-node-b"]
    ns = await worker_namespace(a)
    assert ns and ns == await worker_namespace(b)
    first = await generate(a, PROMPTS["shared-a"], "shared-a")
    assert list(first.token_ids) == reference["shared-a"]
    hashes = list(first.prompt_block_hashes)
    full = len(PREFIX) // 16  # pages of the prefix (the rest differ between the prompts)
    await wait_indexed(nodes["index"], ns, hashes, f"agent-node-a-{vllm_cluster.tag}", full)
    # vLLM's device pool is announced too, under the worker's own lease (its KV events):
    # every full page of the prompt, in whole vLLM blocks.
    in_device = len(PROMPTS["shared-a"]) // BLOCK * BLOCK // 16
    await wait_indexed(nodes["index"], ns, hashes, f"vllm-node-a-{vllm_cluster.tag}", in_device)

    second = await generate(b, PROMPTS["shared-b"], "shared-b")
    assert list(second.token_ids) == reference["shared-b"]
    # Whole vLLM blocks of the prefix came from node-a's agent (through node-b's).
    assert second.usage.cached_tokens >= len(PREFIX) // BLOCK * BLOCK > 0
    assert list(second.prompt_block_hashes)[:full] == hashes[:full]
    # The worker's Prometheus series count them as hits from the agent.
    b_proc = vllm_cluster.by_name["vllm-node-b"]
    hits = 'omniflow_worker_prefix_cache_hit_tokens_total{source="agent"}'
    assert await asyncio.to_thread(metric, b_proc, hits) >= len(PREFIX) // BLOCK * BLOCK
    assert await indexed(nodes["index"], ns, hashes, f"agent-node-b-{vllm_cluster.tag}") >= 12


def _transformers_kv(folder, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer for ``prompt`` by transformers in float32 (after RoPE, as a
    cache holds them): [layers, kv heads, tokens, head dim] each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    layers = range(model.config.num_hidden_layers)
    k = torch.stack([cache.layers[i].keys[0] for i in layers])
    v = torch.stack([cache.layers[i].values[0] for i in layers])
    return k, v


def _within_bf16(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float, float]:
    """Per K/V and layer: |got - want| <= 5% of the layer's largest value + 0.05 (bfloat16
    rounding through 30 layers)."""
    err = (got.float() - want).abs().amax(dim=(2, 3, 4))
    scale = want.abs().amax(dim=(2, 3, 4))
    return bool((err <= 0.05 * scale + 0.05).all()), err.max().item(), scale.max().item()


async def test_vllm_pages_are_the_builtin_engines_pages(nodes, vllm_cluster) -> None:
    """The pages a vLLM worker stores hold the K/V transformers computes for the same tokens
    (float32, the reference), to bfloat16 rounding, in the contract's byte order and
    namespace, and so do the built-in engine's: each engine can load the other's pages.
    (Two bfloat16 implementations may each sit near the bound on the other side of the
    reference, so each is held to the reference, not to the other.)"""
    a = nodes["worker-node-a"]
    ns = await worker_namespace(a)
    prompt = PROMPTS["shared-a"]
    reply = await generate(a, prompt, "pages-a")  # stored now, or held since an earlier test
    full = len(PREFIX) // 16
    owner = f"agent-node-a-{vllm_cluster.tag}"
    await wait_indexed(nodes["index"], ns, list(reply.prompt_block_hashes), owner, full)

    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=64 * 1024 * 1024)
    engine = await asyncio.to_thread(Engine, vllm_cluster.model, config)
    assert engine.layout.namespace_hex == ns
    request = GenerateRequest(
        "kv", prompt_token_ids=prompt, params=SamplingParams(1, 0.0), return_kv=True
    )
    kv = None
    async for out in engine.generate(request):
        kv = out.kv if out.kv is not None else kv
    assert kv is not None
    ours_k, ours_v = (t.float().cpu() for t in kv)  # [layers, kv heads, prompt, head dim]
    k, v = await asyncio.to_thread(_transformers_kv, vllm_cluster.model, prompt)

    store = AgentPageStore(nodes["agent-node-a"], engine.layout, index_address=nodes["index"])
    try:
        pages = await asyncio.to_thread(store.get, list(reply.prompt_block_hashes)[:full])
    finally:
        store.close()
    assert len(pages) == full
    for i, page in enumerate(pages):
        rows = slice(i * 16, (i + 1) * 16)
        got = torch.from_numpy(page).view(torch.bfloat16).reshape(engine.layout.page_shape)
        want = torch.stack([k[:, :, rows], v[:, :, rows]])
        ok, err, scale = _within_bf16(got, want)
        assert ok, ("vLLM's page", i, err, scale)
        ours = torch.stack([ours_k[:, :, rows], ours_v[:, :, rows]])
        ok, err, scale = _within_bf16(ours, want)
        assert ok, ("the built-in engine's page", i, err, scale)


async def test_agent_killed_before_the_pull_means_recompute(nodes, reference, vllm_cluster) -> None:
    a, b = nodes["worker-node-a"], nodes["worker-node-b"]
    ns = await worker_namespace(a)
    first = await generate(a, PROMPTS["kill-a"], "kill-a")
    assert list(first.token_ids) == reference["kill-a"]
    hashes = list(first.prompt_block_hashes)
    pages = len(PREFIX_KILL) // 16
    owner = f"agent-node-a-{vllm_cluster.tag}"
    await wait_indexed(nodes["index"], ns, hashes, owner, pages)

    vllm_cluster.by_name["agent-node-a"].kill()
    # Its lease runs on: node-b's connector is told node-a holds the prefix, and the pull
    # from the dead agent fails inside vLLM's step.
    assert await indexed(nodes["index"], ns, hashes, owner) >= pages
    second = await generate(b, PROMPTS["kill-b"], "kill-b")
    assert list(second.token_ids) == reference["kill-b"]
    log = vllm_cluster.by_name["vllm-node-b"].log.read_text(errors="replace")
    assert "vLLM recomputes the rest" in log


async def test_abort_ends_the_stream_and_load_is_reported(nodes) -> None:
    async with open_channel(nodes["worker-node-b"]) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb2.GenerateRequest(
            request_id="long",
            token_ids=common_pb2.TokenIds(ids=tokens(20, 9)),
            sampling=common_pb2.SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True),
        )
        got, last, aborted = 0, None, False
        async for reply in stub.Generate(request, timeout=300):
            got += len(reply.token_ids)
            last = reply
            if got >= 4 and not aborted:
                load = (await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)).load
                assert load.running_requests + load.waiting_requests == 1
                assert 0 < load.free_pages <= load.total_pages
                reply_abort = await stub.Abort(
                    worker_pb2.AbortRequest(request_id="long"), timeout=5
                )
                assert reply_abort.found
                aborted = True
        assert last is not None and last.finish_reason == worker_pb2.FINISH_REASON_ABORT
        assert got < 3000
        gone = await stub.Abort(worker_pb2.AbortRequest(request_id="long"), timeout=5)
        assert not gone.found
