"""The engine's fast paths keep transformers' results: batched equal-length prompts from
position 0 (fresh K/V attention) and oneDNN linears with prepacked weights (bfloat16)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TinyModel, greedy, run_all

from omniflow_services.worker.engine.model import build_batch, onednn_usable


def test_equal_length_prompts_run_as_one_fresh_batch(tiny: TinyModel) -> None:
    prompts = [tiny.prompt(24, seed=60 + i) for i in range(4)] + [tiny.prompt(9, seed=70)]
    engine = tiny.engine(max_num_batched_tokens=256)
    res = run_all(engine, [greedy(f"r{i}", p, 6) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        tiny.check(p, res[f"r{i}"])


def test_build_batch_groups_consecutive_fresh_prompts() -> None:
    from omniflow_services.worker.engine.model import SeqInput

    seqs = [
        SeqInput([1] * 5, 0, [0], True),
        SeqInput([1] * 5, 0, [1], True),
        SeqInput([2], 7, [2], True),  # a decode row breaks the run
        SeqInput([1] * 5, 0, [3], True),
        SeqInput([1] * 3, 4, [4], True),  # continues a prompt: attends through its pages
    ]
    b = build_batch(seqs, 8, torch.device("cpu"))
    assert [(r.row0, r.count, r.q_len) for r in b.fresh] == [(0, 2, 5), (11, 1, 5)]
    assert len(b.prefills) == 1 and b.prefills[0].q_start == 16
    assert b.slots.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 23, 24, 25, 26, 27, 28, 36, 37, 38]
    assert not b.all_decode


@pytest.mark.skipif(
    not onednn_usable(torch.bfloat16, torch.device("cpu")), reason="needs oneDNN with bf16"
)
def test_prepacked_bfloat16_matches_aten_bfloat16(tiny: TinyModel) -> None:
    prompts = [tiny.prompt(20, seed=80), tiny.prompt(33, seed=81)]
    reqs = [greedy(f"r{i}", p, 8) for i, p in enumerate(prompts)]
    packed = tiny.engine(dtype="bfloat16", matmul="onednn")
    plain = tiny.engine(dtype="bfloat16", matmul="aten")
    assert packed.model.prepacked and not plain.model.prepacked
    a, b = run_all(packed, reqs), run_all(plain, reqs)
    for i in range(len(prompts)):
        ra, rb = a[f"r{i}"], b[f"r{i}"]
        assert ra.logits is not None and rb.logits is not None
        # Same kernels up to accumulation order: bfloat16 rounding, not a different model.
        torch.testing.assert_close(ra.logits, rb.logits, atol=0.05, rtol=0.02)
        assert ra.tokens[:4] == rb.tokens[:4]


def test_decode_kv_copy_is_reused_and_rebuilt_when_the_batch_changes(tiny: TinyModel) -> None:
    """Requests finish at different steps and one arrives late: every change rebuilds the
    contiguous decode K/V, steady steps reuse it, and the outputs stay transformers'. (The
    copy belongs to the torch path; the native kernels read the pages in place.)"""
    prompts = [tiny.prompt(n, seed=90 + n) for n in (7, 19, 40)]
    lengths = [5, 30, 12]
    engine = tiny.engine(max_num_batched_tokens=64, kernels="torch")
    reqs = [greedy(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    for r in reqs[:2]:
        engine.add_request(r)
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            engine.add_request(reqs[2])
        for o in engine.step():
            outs[o.request_id].append(o)
        steps += 1
    dkv = engine.model.decode_kv
    assert dkv is not None
    assert 2 <= dkv.rebuilds < steps // 2  # mostly reused, rebuilt on each change
    for i, p in enumerate(prompts):
        lst = outs[f"r{i}"]
        tokens = [t for o in lst for t in o.new_token_ids]
        logits = torch.cat([o.logits for o in lst if o.logits is not None])
        from engine_helpers import Result

        tiny.check(p, Result(tokens, logits, lst))


def test_without_the_decode_kv_copy_the_outputs_are_the_same(tiny: TinyModel) -> None:
    prompts = [tiny.prompt(n, seed=100 + n) for n in (12, 37)]
    reqs = [greedy(f"r{i}", p, 40) for i, p in enumerate(prompts)]  # past SLACK: a regrow
    kept = run_all(tiny.engine(kernels="torch"), reqs)
    gathered = run_all(tiny.engine(kernels="torch", decode_kv_bytes=0), reqs)
    for rid in kept:
        assert kept[rid].tokens == gathered[rid].tokens
        torch.testing.assert_close(kept[rid].logits, gathered[rid].logits, atol=1e-5, rtol=0)


def test_decode_kv_copy_keeps_a_contiguous_run_when_requests_leave() -> None:
    """Requests leaving from either end of the batch leave the rest a run of the copy's
    rows: used in place (no rebuild); one leaving from the middle, or a join, rebuilds."""
    from omniflow_services.worker.engine.decode_kv import DecodeKV

    dkv = DecodeKV(2, 1, 4, 4, torch.float32, torch.device("cpu"), 1 << 30)
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    first = dkv.plan((1, 2, 3, 4), [5, 6, 7, 8], tables)
    assert first is not None and first.rebuild and dkv.rebuilds == 1
    first.k[0, 0, 2, 0, 0] = 42.0  # row 2 of the copy: request 3
    tail = dkv.plan((2, 3, 4), [7, 8, 9], tables[1:])  # request 1 left: rows 1..3
    assert tail is not None and not tail.rebuild and dkv.rebuilds == 1
    assert tail.k.data_ptr() != first.k.data_ptr() and float(tail.k[0, 0, 1, 0, 0]) == 42.0
    head = dkv.plan((2, 3), [8, 9], tables[1:3])  # request 4 left: rows 1..2
    assert head is not None and not head.rebuild and float(head.k[0, 0, 1, 0, 0]) == 42.0
    gap = dkv.plan((2,), [10], tables[1:2])  # a skipped step (context +2): rebuild
    assert gap is not None and gap.rebuild and dkv.rebuilds == 2
    middle = dkv.plan((5, 6, 7), [3, 3, 3], tables[:3])
    assert middle is not None and middle.rebuild
    assert dkv.plan((5, 7), [4, 4], [tables[0], tables[2]]).rebuild  # the middle one left


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_rms_norm_are_bit_identical_to_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from omniflow_services.worker.engine.model import rms_norm
    from omniflow_services.worker.engine.rope import apply_rotary

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 6, 64, generator=g) * 3).to(dtype)  # [tokens, heads, head_dim]
    freqs = torch.rand(37, 32, generator=g) * 40
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = x.transpose(0, 1)[None]  # transformers' [batch, heads, tokens, head_dim]
    want, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None])
    assert torch.equal(apply_rotary(x, cos, sin), want[0].transpose(0, 1))
    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
        h = (torch.randn(37, 64, generator=g) * 5).to(dtype)
        assert torch.equal(rms_norm(h, norm.weight, 1e-5), norm(h))
