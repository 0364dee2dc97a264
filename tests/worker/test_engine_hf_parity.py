"""The engine's logits equal transformers' (1e-4 abs, float32) and greedy outputs are identical."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import MakeTiny, TinyModel, greedy, run_all

from omniflow_services.worker.engine import GenerateRequest, MemoryConnector, SamplingParams


def test_full_prefill(tiny: TinyModel) -> None:
    prompt = tiny.prompt(40, seed=1)
    res = run_all(tiny.engine(max_num_batched_tokens=512), [greedy("a", prompt, 12)])["a"]
    assert res.final.usage.cached_tokens == 0
    tiny.check(prompt, res)


@pytest.mark.parametrize("budget", [16, 7])
def test_chunked_prefill(tiny: TinyModel, budget: int) -> None:
    prompt = tiny.prompt(53, seed=2)
    engine = tiny.engine(max_num_batched_tokens=budget)
    res = run_all(engine, [greedy("a", prompt, 10)])["a"]
    assert engine.stats.steps == -(-53 // budget) + 9  # the prompt went in chunks, then decode
    tiny.check(prompt, res)


def test_mixed_batch_equals_each_alone(tiny: TinyModel) -> None:
    lengths = [5, 17, 33, 64, 1]
    prompts = [tiny.prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    reqs = [greedy(f"r{i}", p, 9) for i, p in enumerate(prompts)]
    together = run_all(tiny.engine(max_num_batched_tokens=48), reqs)
    for i, p in enumerate(prompts):
        alone = run_all(tiny.engine(), [greedy("x", p, 9)])["x"]
        assert together[f"r{i}"].tokens == alone.tokens
        assert (together[f"r{i}"].logits - alone.logits).abs().max() <= 1e-4  # type: ignore[operator]
        tiny.check(p, together[f"r{i}"])


def test_prefix_reused_from_device_pool(tiny: TinyModel) -> None:
    engine = tiny.engine()
    first = tiny.prompt(48, seed=3)
    run_all(engine, [greedy("a", first, 4, logits=False)])
    second = first[:40] + tiny.prompt(9, seed=4)
    res = run_all(engine, [greedy("b", second, 8)])["b"]
    assert res.final.usage.cached_tokens == 32  # two full pages of 16 shared
    assert engine.stats.device_hit_tokens == 32
    tiny.check(second, res)


def test_whole_prompt_cached_recomputes_last_page(tiny: TinyModel) -> None:
    engine = tiny.engine()
    prompt = tiny.prompt(32, seed=5)
    run_all(engine, [greedy("a", prompt, 3, logits=False)])
    res = run_all(engine, [greedy("b", prompt, 6)])["b"]
    assert res.final.usage.cached_tokens == 16  # at least one token is computed for logits
    tiny.check(prompt, res)


def test_prefix_served_by_connector_from_another_engine(tiny: TinyModel) -> None:
    connector = MemoryConnector()
    producer = tiny.engine(connector=connector)
    prompt = tiny.prompt(70, seed=6)
    run_all(producer, [greedy("a", prompt, 2, logits=False)])
    assert producer.stats.pages_written_through == 4 and len(connector) == 4
    consumer = tiny.engine(connector=connector)
    res = run_all(consumer, [greedy("b", prompt, 8)])["b"]
    assert res.final.usage.cached_tokens == 64
    assert consumer.stats.connector_hit_tokens == 64 and consumer.stats.connector_failures == 0
    tiny.check(prompt, res)


class BrokenConnector:
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def fetch_pages(self, layout, hashes):  # type: ignore[no-untyped-def]
        if self.mode == "raise":
            raise ConnectionError("agent unreachable")
        return [b"\x00" * (layout.page_bytes - 1) for _ in hashes]  # truncated pages

    def store_pages(self, layout, hashes, pages) -> None:  # type: ignore[no-untyped-def]
        raise ConnectionError("agent unreachable")


@pytest.mark.parametrize("mode", ["raise", "short"])
def test_connector_failure_falls_back_to_recompute(tiny: TinyModel, mode: str) -> None:
    engine = tiny.engine(connector=BrokenConnector(mode))
    prompt = tiny.prompt(40, seed=7)
    res = run_all(engine, [greedy("a", prompt, 6)])["a"]
    assert res.final.usage.cached_tokens == 0
    # one failed fetch, one failed write-through of the two full pages
    assert engine.stats.connector_failures == 2
    tiny.check(prompt, res)


def test_preemption_under_a_small_pool_keeps_results(tiny: TinyModel) -> None:
    prompts = [tiny.prompt(30, seed=20 + i) for i in range(4)]
    engine = tiny.engine(num_pages=8, max_num_batched_tokens=64)
    res = run_all(engine, [greedy(f"r{i}", p, 20) for i, p in enumerate(prompts)])
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        tiny.check(p, res[f"r{i}"])
    assert engine.load().free_pages == 8


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_rope_scaling(tiny_factory: MakeTiny, kind: str) -> None:
    tiny = tiny_factory("llama", rope_scaling=ROPE_CASES[kind], max_position=256, rope_theta=500.0)
    prompt = tiny.prompt(90, seed=8)
    engine = tiny.engine(max_num_batched_tokens=32)
    rotary = engine.model.rotary
    assert rotary.rope_type == kind
    if kind != "dynamic":  # dynamic only differs past max_position_embeddings
        plain = 1.0 / (500.0 ** (torch.arange(0, rotary.dim, 2).float() / rotary.dim))
        assert not torch.allclose(rotary.inv_freq, plain)
    res = run_all(engine, [greedy("a", prompt, 8)])["a"]
    tiny.check(prompt, res)


def test_repetition_penalty_matches_transformers(tiny: TinyModel) -> None:
    prompt = tiny.prompt(24, seed=9) + [40] * 8
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)
    res = run_all(tiny.engine(), [GenerateRequest("a", tuple(prompt), params=params)])["a"]
    ref = tiny.hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        do_sample=False,
        repetition_penalty=1.5,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    assert res.tokens == ref[0, len(prompt) :].tolist()
