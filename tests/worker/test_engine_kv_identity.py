"""The engine's pages carry the block identity of DESIGN.md §4.1 (hashes, extra keys, events)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from engine_helpers import run_all

from omniflow.kv.blocks import KVLayout, block_hashes, encode_extra_keys, item_id
from omniflow.models import make_tiny
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest, SamplingParams


class RecordingSink:
    def __init__(self) -> None:
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []

    def publish(self, layout: KVLayout, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        self.stored += stored
        self.removed += removed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("tiny"), vocab=300)


def gen(rid: str, prompt: list[int], n: int = 3, extra: dict[int, bytes] | None = None):  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, tuple(prompt), params=params, extra_keys=extra)


def test_published_hashes_are_the_contract_hashes(model_dir: Path) -> None:
    sink = RecordingSink()
    engine = Engine(model_dir, EngineConfig(num_pages=16, model_id="tiny-llama"), events=sink)
    prompt = list(range(3, 53))  # 50 tokens + 3 generated: 3 full pages
    res = run_all(engine, [gen("a", prompt)])
    full = prompt + res["a"].tokens
    assert engine.layout.model_id == "tiny-llama"
    assert sink.stored == block_hashes(engine.layout.namespace, full[:48], page_size=16)
    assert sink.removed == []
    # A pool this small must evict: the removed hashes are reported too.
    run_all(engine, [gen("b", list(range(60, 290)), n=2)])  # 15 of 16 pages
    assert set(sink.removed) <= set(sink.stored) and sink.removed


def test_extra_keys_separate_otherwise_equal_prompts(model_dir: Path) -> None:
    engine = Engine(model_dir, EngineConfig(num_pages=32))
    prompt = list(range(10, 50))  # 40 tokens: pages 0 and 1 are full
    img1 = {0: encode_extra_keys([(item_id(b"image one"), 0)])}
    img2 = {0: encode_extra_keys([(item_id(b"image two"), 0)])}
    run_all(engine, [gen("a", prompt, extra=img1)])
    other = run_all(engine, [gen("b", prompt, extra=img2)])["b"]
    assert other.final.usage.cached_tokens == 0  # a different image shares nothing
    same = run_all(engine, [gen("c", prompt, extra=img1)])["c"]
    assert same.final.usage.cached_tokens == 32
    assert (
        same.tokens
        == run_all(Engine(model_dir, EngineConfig(num_pages=32)), [gen("d", prompt)])["d"].tokens
    )
