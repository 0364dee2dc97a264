"""Generated tokens/s of the built-in engine against transformers ``generate``, same weights.

Each concurrency level runs N requests (prompt ``--prompt-len`` random token ids, exactly
``--output-len`` generated tokens, greedy) to completion, timing from submission to the
last token, prefill included. transformers runs the same N prompts as one padded batch
(``attention_mask`` given, ``min_new_tokens`` = ``max_new_tokens`` so it never stops early).

    python bench/engine_throughput.py                      # 8 layers, hidden 512; 1, 8, 32
    python bench/engine_throughput.py --concurrency 1,8 --output-len 32   # quicker
    python bench/engine_throughput.py --repeat 3          # best of 3 on a noisy machine
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from omniflow.models import make_tiny
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest, SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_engine(
    model: Path, prompts: list[list[int]], out_len: int, args: argparse.Namespace
) -> float:
    per_req = -(-(len(prompts[0]) + out_len) // args.page_size)
    cfg = EngineConfig(
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        num_pages=per_req * len(prompts) + 8,
        max_num_batched_tokens=args.token_budget,
        max_num_seqs=max(64, len(prompts)),
        enable_prefix_cache=False,  # random prompts share nothing; measure compute only
    )
    engine = Engine(model, cfg)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest("warm", tuple(prompts[0][:32]), params=warm))
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", tuple(p), params=params))
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    assert generated == out_len * len(prompts), generated
    return generated / elapsed


def run_hf(hf: torch.nn.Module, prompts: list[list[int]], out_len: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        hf.generate(
            ids[:1, :32],
            attention_mask=mask[:1, :32],
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=0,
        )  # warm-up
        start = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    assert generated == out_len * len(prompts), generated
    return generated / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None, help="an HF folder (default: make one)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--token-budget", type=int, default=2048, help="engine tokens per step")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per level; the best is kept (noisy hosts)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",") if x]

    with tempfile.TemporaryDirectory(prefix="omniflow-bench-") as tmp:
        model = args.model_dir or make_tiny(
            "llama",
            Path(tmp) / "model",
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
            max_position=max(2048, args.prompt_len + args.output_len),
        )
        hf = None
        if not args.skip_hf:
            import transformers

            dtype = getattr(torch, args.dtype)
            hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
            hf = hf.to(args.device).eval()
            hf.generation_config.eos_token_id = None
        vocab = Engine(model, EngineConfig(num_pages=1)).model_config.vocab_size
        print(
            f"model {model.name}: {args.layers} layers, hidden {args.hidden}, prompt "
            f"{args.prompt_len}, output {args.output_len}, {args.dtype} on {args.device}, "
            f"{torch.get_num_threads()} threads"
        )
        print(f"{'concurrent':>10} | {'engine tok/s':>12} | {'HF tok/s':>10} | {'ratio':>6}")
        print("-" * 49)
        for n in levels:
            prompts = _prompts(n, args.prompt_len, vocab, seed=n)
            ours = max(
                run_engine(model, prompts, args.output_len, args) for _ in range(args.repeat)
            )
            ref = None
            if hf is not None:
                ref = max(
                    run_hf(hf, prompts, args.output_len, args.device) for _ in range(args.repeat)
                )
            ref_s = f"{ref:10.1f}" if ref else f"{'-':>10}"
            ratio = f"{ours / ref:5.2f}x" if ref else f"{'-':>6}"
            print(f"{n:>10} | {ours:12.1f} | {ref_s} | {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
