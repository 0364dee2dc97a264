"""Output tokens/s with a JSON schema against without, at concurrency 1 and 8: the Omni-Flow
gateway (the built-in engine's grammar bitmask, xgrammar) beside vLLM CPU's own OpenAI
server (its structured outputs, xgrammar too), the same model folder (SmolLM2-135M-Instruct,
bfloat16), the same schema, one run.

    python bench/structured_output.py                      # concurrency 1,8; 3 rounds
    python bench/structured_output.py --requests 2 --rounds 1 --concurrency 1   # smoke
    python bench/structured_output.py --skip-vllm

Both servers are started (``serve_stack.py``: for Omni-Flow a private Redis, kv-index,
kv-agent, router, one llm worker and the gateway; vLLM's
``vllm.entrypoints.openai.api_server`` from its own virtualenv) and stay up together; each
level then runs ``--rounds`` times per system and mode, the systems taking turns (a slow
minute of a shared machine hits them alike), and each one's best round is kept. A level is
``--requests`` (default ``2 x concurrency``, at least 4) non-streamed chat completions of
distinct prompts, greedy, ``--max-tokens`` each, ``concurrency`` in flight; tokens/s is the
sum of ``usage.completion_tokens`` over the wall time of the level. With the schema
(``response_format: json_schema``) an answer ends when its JSON is complete; every one is
checked with ``jsonschema`` and the share that validates is printed. Without it, the
answers run to ``max_tokens`` (``ignore_eos``), so that the two modes generate comparable
lengths; the per-token rate is what is compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI
from serve_stack import MODEL, Procs, load_avg, start_omniflow, start_vllm

DEFAULT_VLLM = Path.home() / ".cache/omniflow/venvs/vllm/bin/python"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 4,
        },
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "skills", "employed"],
}
SUBJECTS = [
    "a baker in Lyon", "a pilot from Osaka", "a student in Lima", "a nurse in Oslo",
    "a chess player", "a carpenter", "a marine biologist", "a jazz drummer",
    "a software engineer", "a farmer in Kenya", "a violin teacher", "a firefighter",
    "a librarian", "a race car driver", "an astronaut", "a street painter",
]  # fmt: skip


async def level(
    url: str, conc: int, requests: int, max_tokens: int, schema: bool
) -> dict[str, float]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(conc)
    tokens = 0
    valid = 0
    extra: dict = {}
    if schema:
        extra["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        }
    else:
        extra["extra_body"] = {"ignore_eos": True}

    async def one(i: int) -> None:
        nonlocal tokens, valid
        who = SUBJECTS[i % len(SUBJECTS)]
        async with sem:
            out = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Describe {who} as a JSON object."}],
                max_tokens=max_tokens,
                temperature=0,
                **extra,
            )
        tokens += out.usage.completion_tokens if out.usage else 0
        if schema and _valid(out.choices[0].message.content or ""):
            valid += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    elapsed = time.perf_counter() - start
    await client.close()
    return {"tok_s": tokens / elapsed, "tokens": tokens, "valid": valid / requests}


def _valid(text: str) -> bool:
    try:
        import jsonschema
    except ImportError:  # the figure is then "n/a"
        return False
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def table(results: dict, levels: list[int], systems: list[str]) -> str:
    rows = [
        "| concurrency | mode | " + " | ".join(f"{s} tok/s" for s in systems) + " | ratio |",
        "|---|---|" + "---|" * len(systems) + "---|",
    ]
    for conc in levels:
        for mode in ("free", "schema"):
            cells = [results.get((s, conc, mode)) for s in systems]
            figs = [f"{c['tok_s']:.1f}" if c else "-" for c in cells]
            if mode == "schema":
                figs = [
                    f"{f} ({c['valid']:.0%} valid)" if c else f
                    for f, c in zip(figs, cells, strict=True)
                ]
            ratio = "-"
            if len(cells) == 2 and all(cells):
                ratio = f"{cells[0]['tok_s'] / cells[1]['tok_s']:.2f}"  # type: ignore[index]
            rows.append(f"| {conc} | {mode} | " + " | ".join(figs) + f" | {ratio} |")
    rows.append("")
    rows.append("| concurrency | " + " | ".join(f"{s} schema/free" for s in systems) + " |")
    rows.append("|---|" + "---|" * len(systems))
    for conc in levels:
        cost = []
        for s in systems:
            f, g = results.get((s, conc, "free")), results.get((s, conc, "schema"))
            cost.append(f"{g['tok_s'] / f['tok_s']:.2f}" if f and g else "-")
        rows.append(f"| {conc} | " + " | ".join(cost) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=0, help="per level (0: 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--models-dir", type=Path, default=Path("~/.cache/omniflow/models"))
    args = ap.parse_args()

    from omniflow.models.resolve import resolve_model

    folder = resolve_model(MODEL, args.models_dir.expanduser())
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-structured-bench-"))
    procs = Procs(tmp)
    redis = None
    urls: dict[str, str] = {}
    results: dict[tuple[str, int, str], dict[str, float]] = {}
    loads = [f"start {load_avg()}"]
    try:
        print(f"Omni-Flow gateway ({folder}, bfloat16, {args.threads} threads) ...", flush=True)
        of, redis = start_omniflow(procs, folder, args.threads)
        urls["omni-flow"] = of.url
        if args.skip_vllm:
            pass
        elif not args.vllm_python.exists():
            print(f"no vLLM at {args.vllm_python}: skipped (scripts/setup_vllm_venv.sh)")
        else:
            print("vLLM OpenAI server ...", flush=True)
            urls["vLLM"] = start_vllm(procs, folder, args.vllm_python, args.threads)
        for url in urls.values():  # warm-up: first-call costs, the schema compiled once
            asyncio.run(level(url, 1, 1, 16, True))
            asyncio.run(level(url, 1, 1, 16, False))
        for conc in args.concurrency:
            n = args.requests or max(4, 2 * conc)
            for _ in range(args.rounds):
                for mode in ("free", "schema"):
                    for name, url in urls.items():  # the systems take turns
                        r = asyncio.run(level(url, conc, n, args.max_tokens, mode == "schema"))
                        key = (name, conc, mode)
                        if key not in results or r["tok_s"] > results[key]["tok_s"]:
                            results[key] = r
                        print(f"  {name} c={conc} {mode}: {r['tok_s']:.1f} tok/s", flush=True)
        loads.append(f"end {load_avg()}")
    finally:
        procs.stop()
        if redis is not None:
            redis.stop()  # type: ignore[attr-defined]
    print()
    print(table(results, args.concurrency, list(urls)))
    print(f"\nload average: {'; '.join(loads)}\nlogs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
