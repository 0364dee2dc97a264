"""The same parity checks on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TinyModel, greedy, run_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_mixed_batch_on_gpu_matches_transformers(tiny: TinyModel) -> None:
    prompts = [tiny.prompt(n, seed=30 + n) for n in (7, 40, 77)]
    engine = tiny.engine(device="cuda", max_num_batched_tokens=32)
    res = run_all(engine, [greedy(f"r{i}", p, 10) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        tiny.check(p, res[f"r{i}"])


def test_bfloat16_on_gpu_runs(tiny: TinyModel) -> None:
    engine = tiny.engine(device="cuda", dtype="bfloat16")
    res = run_all(engine, [greedy("a", tiny.prompt(50, seed=3), 10)])
    assert len(res["a"].tokens) == 10
