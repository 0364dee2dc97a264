"""A Llama/Qwen2-family decoder that reads and writes its KV through the paged pool.

One forward runs a flat batch of tokens from several requests: every linear layer sees all
tokens at once; attention is batched across single-token (decode) rows, across runs of
prompts computed from position 0 with equal lengths (they attend to their own fresh K/V,
no page gather), and run per request for the other prefill chunks, whose queries start at
an offset into the request's cached context.

On CPU in bfloat16 the linear layers go through oneDNN with weights reordered once at load
(``PackedLinear``): ``F.linear`` would reorder the weight on every call, which costs more
than the multiply itself for decode-sized batches; batches of up to 8 rows go through the
kernels' GEMV over the plain weight rows instead (bandwidth-bound: it streams the weights
about twice as fast as oneDNN's AMX tiles on one core). On CPU the elementwise work of a layer
(RMSNorm with its residual add, rotary, SiLU-and-multiply, the KV write), decode attention
and fresh prompts' attention (bfloat16) run as fused kernels (``kernels.py``) where they
build; the torch path is kept for other devices and as the fallback, with the same results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

import omniflow_services.worker.engine.kernels as kernels
from omniflow_services.worker.engine.decode_kv import DecodeKV, DecodePlan
from omniflow_services.worker.engine.kv_pool import KVPool
from omniflow_services.worker.engine.rope import Rotary, apply_rotary
from omniflow_services.worker.llm.model_folder import ModelConfig


@dataclass(slots=True)
class LayerWeights:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor
    in_norm: torch.Tensor
    post_norm: torch.Tensor


class PackedLinear:
    """``x @ w.T + b`` through oneDNN with ``w`` reordered once into its blocked layout; with
    ``gemv``, batches of up to ``GEMV_ROWS`` rows go through the kernels' ``small_linear``
    instead (an AVX512-BF16 GEMV straight over ``w``'s rows: a decode step is bound by
    streaming the weights, which oneDNN's AMX tiles, 16 rows tall, do at half the speed)."""

    __slots__ = ("bias", "packed", "rows")

    # The reorder's batch-size hint; measured on par with exact-size packing from 1 to 2048.
    BATCH_HINT = 2048
    # small_linear's largest batch (kernels.cpp kGemvRows); one core, a decode step's
    # linears: 1.9-2.1x oneDNN's time at 1 to 8 rows (bench/kernels.py --cases linears).
    GEMV_ROWS = 8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool = False) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
        self.bias = bias
        self.rows = weight if gemv else None  # the [N, K] rows small_linear reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is not None and 0 < x.shape[0] <= self.GEMV_ROWS and x.stride(-1) == 1:
            return kernels.ops().small_linear(x, self.rows, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


Linear = Callable[[torch.Tensor], torch.Tensor]

# Attention of one layer: (layer index, q [T, heads, D], k and v [T, kv_heads, D], rotated)
# -> output [T, heads, D]. The caller decides which keys each query sees (paged cache,
# a cached prefix, a mask); the layer stack around it is the same for every path.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def onednn_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """True where prepacked oneDNN linears apply: CPU, bfloat16, oneDNN with bf16 support."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, gemv: bool = False
) -> Linear:
    if packed:
        return PackedLinear(weight.contiguous(), bias, gemv)
    return partial(F.linear, weight=weight, bias=bias)


@dataclass(slots=True)
class LayerLinears:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


@dataclass(slots=True)
class FreshRun:
    """``count`` consecutive prompts of ``q_len`` tokens each, all from position 0, at rows
    ``[row0, row0 + count * q_len)``: causal attention over their own K/V."""

    row0: int
    count: int
    q_len: int


@dataclass(slots=True)
class PrefillSeq:
    """One request's chunk: queries at rows [q_start, q_start+q_len) attend to ``ctx_len`` keys."""

    q_start: int
    q_len: int
    pages: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class ForwardBatch:
    """Everything one forward needs; built by ``build_batch`` from per-request slices."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    max_position: int
    slots: torch.Tensor  # page * page_size + offset of every row's K/V
    decode_rows: torch.Tensor | None
    decode_pages: torch.Tensor | None  # [B, width] page tables, padded with the last page
    decode_mask: torch.Tensor | None
    decode_lens: torch.Tensor | None  # [B] context of each decode row (its keys)
    prefills: list[PrefillSeq]
    logit_rows: torch.Tensor
    embed_rows: torch.Tensor | None = None
    embed_values: torch.Tensor | None = None
    fresh: tuple[FreshRun, ...] = ()
    all_decode: bool = False
    # The decode rows' request uids, contexts and page tables (for ``DecodeKV``).
    decode_ids: tuple[int, ...] = ()
    decode_ctx: list[int] | None = None
    decode_tables: list[list[int]] | None = None


@dataclass(slots=True)
class SeqInput:
    """A request's share of a step: ``tokens`` computed at positions start..start+len-1."""

    tokens: list[int]
    start: int
    pages: list[int]
    want_logits: bool
    # Media positions of this chunk (row offsets) and their input embeddings [rows, hidden].
    embed_rows: list[int] | None = None
    embed_values: torch.Tensor | None = None
    uid: int = -1  # the request's unique id (-1: unknown, no decode K/V reuse)


def build_batch(seqs: list[SeqInput], page_size: int, device: torch.device) -> ForwardBatch:
    """Flatten ``seqs`` into one forward: slot mapping for KV writes and attention metadata."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    fresh: list[FreshRun] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_ctx: list[int] = []
    decode_ids: list[int] = []
    prefills: list[PrefillSeq] = []
    logit_rows: list[int] = []
    e_rows: list[int] = []
    e_values: list[torch.Tensor] = []
    for s in seqs:
        row0 = len(ids)
        n = len(s.tokens)
        ctx = s.start + n
        ids.extend(s.tokens)
        if s.embed_rows:
            assert s.embed_values is not None
            for r in s.embed_rows:
                ids[row0 + r] = 0  # a pad id is no vocabulary id: the embedding replaces it
            e_rows.extend(row0 + r for r in s.embed_rows)
            e_values.append(s.embed_values)
        pos.extend(range(s.start, ctx))
        first, last = s.start // page_size, (ctx - 1) // page_size
        for pi in range(first, last + 1):
            base = s.pages[pi] * page_size
            lo = max(s.start, pi * page_size) - pi * page_size
            hi = min(ctx, (pi + 1) * page_size) - pi * page_size
            slots.extend(range(base + lo, base + hi))
        used = s.pages[: (ctx + page_size - 1) // page_size]
        if n == 1:
            decode_rows.append(row0)
            decode_tables.append(used)
            decode_ctx.append(ctx)
            decode_ids.append(s.uid)
        elif s.start == 0:
            prev = fresh[-1] if fresh else None
            if prev and prev.q_len == n and prev.row0 + prev.count * n == row0:
                prev.count += 1
            else:
                fresh.append(FreshRun(row0, 1, n))
        else:
            mask = None
            if s.start > 0 or ctx % page_size:
                # key j is visible to query i (absolute position start+i) when j <= start+i.
                keys = torch.arange(len(used) * page_size, device=device)
                qpos = torch.arange(s.start, ctx, device=device)
                mask = keys[None, :] <= qpos[:, None]
            prefills.append(
                PrefillSeq(row0, n, torch.tensor(used, dtype=torch.long, device=device), mask)
            )
        if s.want_logits:
            logit_rows.append(row0 + n - 1)
    d_rows = d_pages = d_mask = d_lens = None
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        table = [t + [t[-1]] * (width - len(t)) for t in decode_tables]
        d_pages = torch.tensor(table, dtype=torch.long, device=device)
        keys = torch.arange(width * page_size, device=device)
        d_lens = torch.tensor(decode_ctx, dtype=torch.long, device=device)
        d_mask = (keys[None, :] < d_lens[:, None])[:, None, None, :]
        d_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=t(ids),
        positions=t(pos),
        max_position=max(pos),
        slots=t(slots),
        decode_rows=d_rows,
        decode_pages=d_pages,
        decode_mask=d_mask,
        decode_lens=d_lens,
        prefills=prefills,
        logit_rows=t(logit_rows),
        embed_rows=t(e_rows) if e_rows else None,
        embed_values=torch.cat(e_values) if e_values else None,
        fresh=tuple(fresh),
        all_decode=len(decode_rows) == len(ids),
        decode_ids=tuple(decode_ids),
        decode_ctx=decode_ctx,
        decode_tables=decode_tables,
    )


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen2 compute it: in float32, scaled by ``w`` in ``x``'s dtype.

    ``F.rms_norm`` is one fused pass (the spelled-out version was seven); in float32 it
    equals transformers' result bit for bit, and so does normalising in float32 then scaling
    in ``x``'s dtype for half types (measured; 2048 bf16 rows 2.8 ms against 4.7 ms)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class DecoderModel:
    """Llama/Qwen2 decoder over plain weight tensors (no autograd, no nn.Module overhead)."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        *,
        prepack: bool | None = None,
        fused: str = "auto",
    ) -> None:
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self.rotary = Rotary(cfg, self.device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.prepacked = onednn_usable(self.dtype, self.device) if prepack is None else prepack
        pk = self.prepacked
        # The fused CPU kernels ("auto": where they apply and build; "torch": never).
        self.fused = kernels.wanted(fused, self.dtype, self.device) and cfg.head_dim % 16 == 0
        # Small batches of the prepacked bfloat16 linears through the kernels' GEMV.
        self.gemv = pk and self.fused and bool(kernels.ops().small_linear_supported())
        gv = self.gemv
        # Fresh prompts' causal attention by the kernels' blocked form (bfloat16): one core,
        # 264 to 1,024 tokens, 1.9-4x torch's SDPA (bench/kernels.py --cases prefill).
        self.prefill_kernel = self.gemv and cfg.head_dim in (64, 128)
        self.linears = [
            LayerLinears(
                qkv=make_linear(lw.qkv_w, lw.qkv_b, pk, gv),
                o=make_linear(lw.o_w, None, pk, gv),
                gate_up=make_linear(lw.gate_up_w, None, pk, gv),
                down=make_linear(lw.down_w, None, pk, gv),
            )
            for lw in layers
        ]
        self.lm = make_linear(lm_head, None, pk, gv)
        # Set by the engine (it knows the page size and the memory budget).
        self.decode_kv: DecodeKV | None = None
        # Decode attention with grouped query heads as rows of their KV head: measured
        # faster in float32 (1.0 against 1.65 ms a layer at 32 rows of 288 keys), slightly
        # slower in bfloat16, where CPU SDPA's own GQA path is kept.
        self.gqa_rows = self.dtype == torch.float32 and cfg.num_heads % cfg.num_kv_heads == 0

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """The decoder layers over hidden states ``h`` [T, hidden] at ``positions``, with
        ``attend`` as each layer's attention; returns the last layer's output (not normed).

        The one layer stack of the worker: the LLM forward, the diffusion denoiser and the
        codec talker all run through it."""
        cfg = self.cfg
        if max_position is None:
            max_position = int(positions.max())
        cos, sin = self.rotary.cos_sin(positions, self.dtype, max_position)
        if self.fused:
            return self._run_layers_fused(h, cos, sin, attend)
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_size = self.q_size + self.kv_size
        inter = cfg.intermediate_size
        for li, (lw, lin) in enumerate(zip(self.layers, self.linears, strict=True)):
            x = rms_norm(h, lw.in_norm, cfg.rms_norm_eps)
            qkv = lin.qkv(x)
            # q and k rotate together: one set of rotary ops per layer, not two.
            qk = apply_rotary(qkv[:, :qk_size].view(-1, nh + kvh, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, qk_size:].view(-1, kvh, hd)
            attn = attend(li, q, k, v)
            h = h + lin.o(attn.reshape(-1, self.q_size))
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            gu = lin.gate_up(x)
            h = h + lin.down(F.silu(gu[:, :inter]) * gu[:, inter:])
        return h

    def _run_layers_fused(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """``run_layers`` through the fused kernels: each residual add is folded into the
        next RMSNorm, rotary runs in place on the QKV projection, SiLU-and-multiply is one
        pass. Roundings as in the torch path (bit-identical in bfloat16)."""
        cfg = self.cfg
        ops = kernels.ops()
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_size = self.q_size + self.kv_size
        eps = cfg.rms_norm_eps
        h = h.contiguous().clone()  # the residual stream is updated in place
        x = torch.empty_like(h)
        act = h.new_empty(h.shape[0], cfg.intermediate_size)
        delta: torch.Tensor | None = None
        for li, (lw, lin) in enumerate(zip(self.layers, self.linears, strict=True)):
            if delta is None:
                ops.rms_norm(h, lw.in_norm, eps, x)
            else:
                ops.add_rms_norm(h, delta, lw.in_norm, eps, x)
            qkv = lin.qkv(x)
            qk = qkv[:, :qk_size].view(-1, nh + kvh, hd)
            ops.rotary_(qk, cos, sin)
            v = qkv[:, qk_size:].view(-1, kvh, hd)
            attn = attend(li, qk[:, :nh], qk[:, nh:], v)
            ops.add_rms_norm(h, lin.o(attn.reshape(-1, self.q_size)), lw.post_norm, eps, x)
            ops.silu_mul(lin.gate_up(x), act)
            delta = lin.down(act)
        if delta is not None:
            h.add_(delta)
        return h

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm (before the LM head)."""
        return rms_norm(h, self.final_norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run the batch, write its K/V into ``pool``; return logits [len(logit_rows), vocab]."""
        kvh, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        h = F.embedding(batch.input_ids, self.embed)
        if batch.embed_rows is not None:
            h.index_copy_(0, batch.embed_rows, batch.embed_values.to(h.dtype))
        plan = self._decode_plan(batch)

        def paged(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = pool.layer(li)
            if self.fused:
                kernels.ops().write_kv(k, v, batch.slots, k_cache, v_cache)
            else:
                # caches are [H, pages, P, D], written through their [H, pages * P, D] views.
                k_cache.view(kvh, -1, hd).index_copy_(1, batch.slots, k.transpose(0, 1))
                v_cache.view(kvh, -1, hd).index_copy_(1, batch.slots, v.transpose(0, 1))
            return self._attention(q, k, v, batch, k_cache, v_cache, plan, li)

        h = self.run_layers(h, batch.positions, paged, batch.max_position)
        last = self.norm(h.index_select(0, batch.logit_rows))
        return self.lm(last).float()

    @torch.inference_mode()
    def logits_for(self, seq: SeqInput, pool: KVPool) -> torch.Tensor:
        """One request's step on its own (no batching): logits [vocab] of its last token."""
        batch = build_batch([seq], pool.layout.page_size, self.device)
        return self.forward(batch, pool)[0]

    def _decode_plan(self, batch: ForwardBatch) -> DecodePlan | None:
        dkv = self.decode_kv
        if dkv is None or self.fused or batch.decode_rows is None or -1 in batch.decode_ids:
            return None
        assert batch.decode_ctx is not None and batch.decode_tables is not None
        return dkv.plan(batch.decode_ids, batch.decode_ctx, batch.decode_tables)

    def _decode_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        li: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's decode keys/values [B, H, used, D] from the kept contiguous copy."""
        kw, vw = plan.k[li], plan.v[li]  # [H, B, width, D]
        if plan.table is not None:  # rebuild from the pool (this step's token is there)
            flat = plan.table.view(-1)
            torch.index_select(
                k_cache, 1, flat, out=kw.view(k_cache.shape[0], -1, *k_cache.shape[2:])
            )
            torch.index_select(
                v_cache, 1, flat, out=vw.view(v_cache.shape[0], -1, *v_cache.shape[2:])
            )
        else:  # one new token per row
            assert batch.decode_rows is not None
            kw[:, plan.rows, plan.new_pos] = k.index_select(0, batch.decode_rows).transpose(0, 1)
            vw[:, plan.rows, plan.new_pos] = v.index_select(0, batch.decode_rows).transpose(0, 1)
        used = plan.used
        return kw[:, :, :used].transpose(0, 1), vw[:, :, :used].transpose(0, 1)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan | None = None,
        li: int = 0,
    ) -> torch.Tensor:
        hd = self.cfg.head_dim
        kvh = self.cfg.num_kv_heads
        nh = self.cfg.num_heads
        out = q.new_empty(q.shape[0], nh, hd)
        for run in batch.fresh:
            rows = slice(run.row0, run.row0 + run.count * run.q_len)
            if self.prefill_kernel:
                kernels.ops().prefill_attention(
                    q[rows], k[rows], v[rows], run.q_len, self.scale, out[rows]
                )
                continue
            # [T, H, D] rows of `count` prompts -> [count, H, q_len, D]
            qq = q[rows].unflatten(0, (run.count, run.q_len)).transpose(1, 2)
            kk = k[rows].unflatten(0, (run.count, run.q_len)).transpose(1, 2)
            vv = v[rows].unflatten(0, (run.count, run.q_len)).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, scale=self.scale, enable_gqa=True
            )
            out[rows] = o.transpose(1, 2).flatten(0, 1)
        if batch.decode_rows is not None and self.fused:
            # Each row's keys read in place from its pages; output written at its row.
            kernels.ops().decode_attention(
                q,
                batch.decode_rows,
                k_cache,
                v_cache,
                batch.decode_pages,
                batch.decode_lens,
                self.scale,
                out,
            )
            if batch.all_decode:
                return out
        elif batch.decode_rows is not None:
            mask = batch.decode_mask
            if plan is not None:
                kk, vv = self._decode_kv(k, v, batch, k_cache, v_cache, plan, li)
                mask = plan.mask
            else:
                assert batch.decode_pages is not None
                b = batch.decode_pages.shape[0]
                flat = batch.decode_pages.view(-1)
                # index_select (about 2x faster than advanced indexing) gives
                # [H, B*pages, P, D]; viewed as [B, H, pages*P, D] without a second copy.
                kk = k_cache.index_select(1, flat).view(kvh, b, -1, hd).transpose(0, 1)
                vv = v_cache.index_select(1, flat).view(kvh, b, -1, hd).transpose(0, 1)
            qd = q.index_select(0, batch.decode_rows)
            if self.gqa_rows:
                # The query heads of one KV head as that head's query rows: SDPA reads each
                # key once instead of once per query head.
                o = F.scaled_dot_product_attention(
                    qd.view(-1, kvh, nh // kvh, hd), kk, vv, attn_mask=mask, scale=self.scale
                ).view(-1, nh, hd)
            else:
                o = F.scaled_dot_product_attention(
                    qd[:, :, None, :], kk, vv, attn_mask=mask, scale=self.scale, enable_gqa=True
                )[:, :, 0, :]
            if batch.all_decode:
                return o
            out.index_copy_(0, batch.decode_rows, o)
        for p in batch.prefills:
            kk = k_cache.index_select(1, p.pages).view(kvh, -1, hd)[None]
            vv = v_cache.index_select(1, p.pages).view(kvh, -1, hd)[None]
            qq = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qq,
                kk,
                vv,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        return out
