"""The engine's fused CPU kernels against transformers' modules and torch's attention.

bfloat16: RMSNorm (with its residual add), rotary and SiLU-and-multiply are bit-identical to
transformers' ``LlamaRMSNorm``, ``apply_rotary_pos_emb`` and ``LlamaMLP``'s activation; in
float32 they agree to float rounding. Decode attention over pages equals float64 SDPA over
the same keys to float32 accuracy. Bad input is refused with an error, never a crash.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omniflow_services.worker.engine import kernels

pytestmark = pytest.mark.skipif(not kernels.load(), reason="no C++ compiler for the kernels")
transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)

DTYPES = [torch.bfloat16, torch.float32]


def same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_llama_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
        h = (torch.randn(97, 576, generator=g) * 5).to(dtype)
        d = torch.randn(97, 576, generator=g).to(dtype)
        out = torch.empty_like(h)
        kernels.ops().rms_norm(h, norm.weight, 1e-5, out)
        same(out, norm(h), dtype)
        stream = h.clone()
        kernels.ops().add_rms_norm(stream, d, norm.weight, 1e-5, out)
        assert torch.equal(stream, h + d)  # the residual add, rounded once as torch does
        same(out, norm(h + d), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_apply_rotary_pos_emb(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    tokens, heads, dim = 41, 12, 64
    x = (torch.randn(tokens, heads, dim, generator=g) * 3).to(dtype)
    freqs = torch.rand(tokens, dim // 2, generator=g) * 40
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want, _ = apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x[:1].transpose(0, 1)[None], cos[None], sin[None]
    )
    # rotated in place inside a wider row, as the QKV projection's q and k heads are
    qkv = torch.zeros(tokens, (heads + 3) * dim, dtype=dtype)
    qkv[:, : heads * dim] = x.reshape(tokens, -1)
    view = qkv[:, : heads * dim].view(tokens, heads, dim)
    kernels.ops().rotary_(view, cos, sin)
    assert torch.equal(view, want[0].transpose(0, 1))  # every dtype: the same roundings
    assert torch.equal(qkv[:, heads * dim :], torch.zeros(tokens, 3 * dim, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_llama_mlp_activation(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    inter = 1536
    gu = (torch.randn(33, 2 * inter + 0, generator=g) * 4).to(dtype)
    gu[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 30.0, -30.0])
    # exp's edges: denormal and overflowing exponentials, infinities
    gu[1, :8] = torch.tensor([-95.0, -104.5, 88.6, -88.8, 87.0, -87.5, float("inf"), 200.0])
    gu[2, :3] = torch.tensor([float("-inf"), -200.0, 1e-38])
    out = torch.empty(33, inter, dtype=dtype)
    kernels.ops().silu_mul(gu, out)
    act = ACT2FN["silu"]
    want = act(gu[:, :inter]) * gu[:, inter:]
    assert torch.equal(out.isnan(), want.isnan())  # silu(-inf) = -inf / inf, as torch
    same(out.nan_to_num(0.0), want.nan_to_num(0.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 32])  # 64: the compiled-in (group, dim) variant
def test_paged_decode_attention_equals_sdpa_over_the_same_keys(
    dtype: torch.dtype, dim: int
) -> None:
    g = torch.Generator().manual_seed(4)
    kv_heads, heads, page, pages = 3, 9, 16, 80
    k_cache = torch.randn(kv_heads, pages, page, dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, pages, page, dim, generator=g).to(dtype)
    lens = torch.tensor([1, 16, 17, 50, 200, 301])
    width = 20
    tables = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in lens])
    q = torch.randn(9, heads, dim, generator=g).to(dtype)
    rows = torch.tensor([0, 2, 3, 5, 7, 8])
    out = torch.full_like(q, 7.0)
    kernels.ops().decode_attention(q, rows, k_cache, v_cache, tables, lens, 0.125, out)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-6
    for b, n in enumerate(lens.tolist()):
        keys = k_cache[:, tables[b]].reshape(kv_heads, -1, dim)[:, :n].double()
        values = v_cache[:, tables[b]].reshape(kv_heads, -1, dim)[:, :n].double()
        want = F.scaled_dot_product_attention(
            q[rows[b]].double()[None, :, None],
            keys[None],
            values[None],
            scale=0.125,
            enable_gqa=True,
        )[0, :, 0]
        torch.testing.assert_close(out[rows[b]].double(), want, atol=tol, rtol=tol)
    untouched = [r for r in range(9) if r not in rows.tolist()]
    assert torch.equal(out[untouched], torch.full_like(out[untouched], 7.0))


def test_write_kv_places_rows_like_index_copy() -> None:
    g = torch.Generator().manual_seed(5)
    kv_heads, dim = 3, 64
    cache = torch.randn(kv_heads, 8, 16, dim, generator=g)
    kv = torch.randn(5, 2 * kv_heads * dim, generator=g)
    k = kv[:, : kv_heads * dim].view(5, kv_heads, dim)
    v = kv[:, kv_heads * dim :].view(5, kv_heads, dim)
    slots = torch.tensor([0, 17, 40, 3, 127])
    k_got, v_got = cache.clone(), cache.clone()
    kernels.ops().write_kv(k, v, slots, k_got, v_got)
    k_want, v_want = cache.clone(), cache.clone()
    k_want.view(kv_heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
    v_want.view(kv_heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


gemv = pytest.mark.skipif(
    not kernels.ops().small_linear_supported(), reason="this CPU has no AVX512-BF16"
)


@gemv
@pytest.mark.parametrize("rows", range(1, 9))
def test_small_linear_equals_linear_to_bfloat16_rounding(rows: int) -> None:
    """The GEMV against float64 and against ``F.linear`` in bfloat16 (oneDNN): one rounding of a
    float32 sum to bfloat16, so within bfloat16's half step of the exact result (plus float32
    accumulation error); shapes with tails (K not a multiple of 32, N of 16), with a bias."""
    g = torch.Generator().manual_seed(10 + rows)
    for n, k, bias in [(960, 576, False), (576, 1536, True), (37, 50, True), (5, 17, False)]:
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
        got = kernels.ops().small_linear(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
        bound = exact.abs() * 2**-8 + 1e-5 * k
        assert bool(((got.double() - exact).abs() <= bound).all())
        torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-2, rtol=2**-7)


@gemv
def test_small_linear_split_over_threads_gives_the_same_bits() -> None:
    g = torch.Generator().manual_seed(20)
    x = torch.randn(3, 576, generator=g).to(torch.bfloat16)
    w = torch.randn(4099, 576, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.ops().small_linear(x, w, None)
        torch.set_num_threads(2)
        two = kernels.ops().small_linear(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    # A strided view of the rows (the logits' rows of a batch) reads the same as a copy.
    wide = torch.randn(3, 1000, generator=g).to(torch.bfloat16)
    wide[:, :576] = x
    assert torch.equal(kernels.ops().small_linear(wide[:, :576], w, None), one)


@gemv
def test_small_linear_refuses_bad_input() -> None:
    ops = kernels.ops()
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"outside 1\.\.8"):
        ops.small_linear(torch.zeros(9, 64, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="takes bfloat16"):
        ops.small_linear(torch.zeros(1, 64), w.float(), None)
    with pytest.raises(RuntimeError, match="contiguous w"):
        ops.small_linear(torch.zeros(1, 32, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.small_linear(torch.zeros(1, 64, dtype=torch.bfloat16), w, torch.zeros(15))


@gemv
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_attention_equals_causal_sdpa(dim: int) -> None:
    """Fresh prompts' blocked causal attention (rows strided inside the QKV projection, as
    the model passes them) against float64 SDPA: bfloat16 output rounding apart, as torch's
    own bfloat16 SDPA; lengths that are and are not multiples of the 16-position block."""
    g = torch.Generator().manual_seed(30 + dim)
    heads, kv_heads = 9, 3
    for length, count in [(1, 2), (5, 3), (16, 1), (17, 2), (100, 1), (264, 1)]:
        t = length * count
        qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
        q = qkv[:, : heads * dim].view(t, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
        out = torch.full((t, heads, dim), 7.0, dtype=torch.bfloat16)
        kernels.ops().prefill_attention(q, k, v, length, dim**-0.5, out)

        def per_prompt(x: torch.Tensor, shape: tuple[int, int] = (count, length)) -> torch.Tensor:
            return x.unflatten(0, shape).transpose(1, 2)

        args = dict(is_causal=True, scale=dim**-0.5, enable_gqa=True)
        exact = F.scaled_dot_product_attention(
            per_prompt(q).double(), per_prompt(k).double(), per_prompt(v).double(), **args
        )
        want = exact.transpose(1, 2).flatten(0, 1)
        ref = F.scaled_dot_product_attention(per_prompt(q), per_prompt(k), per_prompt(v), **args)
        torch_err = (ref.transpose(1, 2).flatten(0, 1).double() - want).abs().max()
        err = (out.double() - want).abs().max()
        assert float(err) <= max(float(torch_err), 2**-8) * 1.5, (length, float(err))
    with pytest.raises(RuntimeError, match="no whole prompts"):
        kernels.ops().prefill_attention(q, k, v, 7, 0.1, out)
    with pytest.raises(RuntimeError, match="head_dim"):
        small = torch.zeros(4, 2, 32, dtype=torch.bfloat16)
        kernels.ops().prefill_attention(small, small, small, 4, 0.1, small.clone())


def test_bad_input_is_refused_with_an_error() -> None:
    ops = kernels.ops()
    cache = torch.zeros(2, 4, 16, 32)
    k = torch.zeros(2, 2, 32)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.write_kv(k, k, torch.tensor([0, 64]), cache, cache.clone())
    q = torch.zeros(1, 4, 32)
    with pytest.raises(RuntimeError, match="page out of range"):
        ops.decode_attention(
            q,
            torch.tensor([0]),
            cache,
            cache,
            torch.tensor([[9]]),
            torch.tensor([3]),
            1.0,
            q.clone(),
        )
    with pytest.raises(RuntimeError, match="length"):
        ops.decode_attention(
            q,
            torch.tensor([0]),
            cache,
            cache,
            torch.tensor([[0]]),
            torch.tensor([17]),
            1.0,
            q.clone(),
        )
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.rms_norm(
            torch.zeros(2, 8, dtype=torch.float16),
            torch.ones(8, dtype=torch.float16),
            1e-6,
            torch.zeros(2, 8, dtype=torch.float16),
        )


def test_engine_with_kernels_matches_transformers_in_bfloat16(tiny_factory) -> None:  # type: ignore[no-untyped-def]
    """A mixed batch (chunked prefill, decode) in bfloat16 on both paths: at every generated
    position the logits equal transformers' bfloat16 forward over the same tokens up to
    bfloat16 rounding (attention accumulates differently: SDPA rounds its probabilities to
    bfloat16, the kernel keeps float32)."""
    from engine_helpers import greedy, run_all

    tiny = tiny_factory("llama", shards=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.bfloat16).eval()
    prompts = [tiny.prompt(n, seed=300 + n) for n in (5, 23, 40)]
    reqs = [greedy(f"r{i}", p, 10) for i, p in enumerate(prompts)]
    for kind in ("native", "torch"):
        engine = tiny.engine(dtype="bfloat16", kernels=kind, max_num_batched_tokens=32)
        assert engine.model.fused == (kind == "native")
        gemv_here = engine.model.prepacked and kernels.ops().small_linear_supported()
        assert engine.model.gemv == (kind == "native" and gemv_here)
        res = run_all(engine, reqs)
        for i, p in enumerate(prompts):
            got = res[f"r{i}"]
            assert got.logits is not None
            with torch.no_grad():
                want = hf(torch.tensor([p + got.tokens])).logits[0, len(p) - 1 : -1].float()
            torch.testing.assert_close(got.logits, want, atol=0.2, rtol=0.02)
            assert got.tokens[0] == int(want[0].argmax())
