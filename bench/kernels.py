"""The engine's CPU kernels against the torch/oneDNN ops they replace, in one process.

Shapes are SmolLM2-135M's (hidden 576, MLP 1536, 9 heads over 3 KV heads of 64, vocab
49,152), bfloat16. Each case times both sides alternately, many repeats, the median kept,
so a slow moment of a shared machine hits both. Bind it to one core for the one-core
figures:

    taskset -c 1 python bench/kernels.py                    # all cases, one thread
    taskset -c 1 python bench/kernels.py --cases linears --rows 1,4,8
    python bench/kernels.py --threads 2 --cases linears     # the multi-threaded split

Cases:
  linears   a decode step's 121 linears (30 layers x qkv/o/gate_up/down + the tied LM head,
            each its own weight: ~255 MB streamed from memory, as in the engine) at
            ``--rows`` rows: ``small_linear`` (the AVX512-BF16 GEMV) against oneDNN with
            prepacked weights (``PackedLinear``, the engine's path for larger batches)
  silu      SiLU-and-multiply of [T, 2 x 1536]: ``silu_mul`` against ``F.silu(g) * u``
  prefill   causal attention of one fresh prompt of 256..1024 tokens (9 heads over 3):
            ``prefill_attention`` (blocked, online softmax) against torch's SDPA
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from omniflow_services.worker.engine import kernels
from omniflow_services.worker.engine.model import PackedLinear

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 576, 1536, 9, 3, 64, 49152, 30


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Least seconds of each function, the functions run in turn ``repeats`` times."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def bench_linears(rows: list[int], repeats: int) -> None:
    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)

    shapes = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN)]
    shapes += [(2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [weight(n, k) for _ in range(LAYERS) for n, k in shapes] + [weight(VOCAB, HIDDEN)]
    packed = [PackedLinear(w, None) for w in weights]
    mb = sum(w.numel() * 2 for w in weights) / 1e6
    ops = kernels.ops()
    print(f"linears: {len(weights)} weights, {mb:.0f} MB, {torch.get_num_threads()} thread(s)")
    print("| rows | oneDNN prepacked ms | small_linear ms | speed-up | small_linear GB/s |")
    print("|---|---|---|---|---|")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in (HIDDEN, INTER)}

        def onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for w, p in zip(weights, packed, strict=True):
                p(xs[w.shape[1]])

        def gemv(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in weights:
                ops.small_linear(xs[w.shape[1]], w, None)

        t = timed({"onednn": onednn, "gemv": gemv}, repeats)
        print(
            f"| {m} | {t['onednn'] * 1e3:.2f} | {t['gemv'] * 1e3:.2f} | "
            f"{t['onednn'] / t['gemv']:.2f}x | {mb / 1e3 / t['gemv']:.1f} |"
        )


def bench_silu(tokens: list[int], repeats: int) -> None:
    g = torch.Generator().manual_seed(1)
    ops = kernels.ops()
    print("| tokens | F.silu(g) * u ms | silu_mul ms | speed-up | silu_mul cycles/16 at 3 GHz |")
    print("|---|---|---|---|---|")
    for t in tokens:
        gu = torch.randn(t, 2 * INTER, generator=g).to(torch.bfloat16)
        out = torch.empty(t, INTER, dtype=torch.bfloat16)

        def ref(gu: torch.Tensor = gu) -> None:
            F.silu(gu[:, :INTER]) * gu[:, INTER:]

        def fused(gu: torch.Tensor = gu, out: torch.Tensor = out) -> None:
            ops.silu_mul(gu, out)

        r = timed({"torch": ref, "fused": fused}, repeats)
        cyc = r["fused"] * 3e9 / (t * INTER / 16)
        print(
            f"| {t} | {r['torch'] * 1e3:.3f} | {r['fused'] * 1e3:.3f} | "
            f"{r['torch'] / r['fused']:.2f}x | {cyc:.1f} |"
        )


def bench_prefill(lengths: list[int], repeats: int) -> None:
    g = torch.Generator().manual_seed(2)
    scale = HEAD_DIM**-0.5
    ops = kernels.ops()
    print("| tokens | torch SDPA ms (a layer) | prefill_attention ms | speed-up |")
    print("|---|---|---|---|")
    for n in lengths:
        # q, k, v as the model has them: heads of one QKV projection row
        qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(torch.bfloat16)
        q = qkv[:, : HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(n, KV_HEADS, HEAD_DIM)
        out = torch.empty(n, HEADS, HEAD_DIM, dtype=torch.bfloat16)

        def sdpa(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, out=out) -> None:
            qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True
            )
            out.copy_(o[0].transpose(0, 1))

        def fused(q=q, k=k, v=v, n: int = n, out: torch.Tensor = out) -> None:
            ops.prefill_attention(q, k, v, n, scale, out)

        r = timed({"sdpa": sdpa, "fused": fused}, repeats)
        print(
            f"| {n} | {r['sdpa'] * 1e3:.3f} | {r['fused'] * 1e3:.3f} | "
            f"{r['sdpa'] / r['fused']:.2f}x |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default="linears,silu,prefill")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8", help="rows of the linears case")
    ap.add_argument("--tokens", default="1,32,264,2048", help="rows of the silu case")
    ap.add_argument("--lengths", default="256,512,1024", help="prompt lengths of prefill")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not kernels.load():
        print("the engine's kernels did not build on this machine")
        return 1
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    cases = set(args.cases.split(","))
    with torch.inference_mode():
        if "linears" in cases:
            if not kernels.ops().small_linear_supported():
                print("linears: this CPU has no AVX512-BF16 (small_linear not built)")
            else:
                bench_linears(ints(args.rows), args.repeats)
        if "silu" in cases:
            bench_silu(ints(args.tokens), args.repeats * 5)
        if "prefill" in cases:
            bench_prefill(ints(args.lengths), args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
