"""The table ``serve_openai.py`` prints: the issue's rows (per Omni-Flow system and
concurrency, ours / vLLM's server) for aiperf and for the script's own client, then the
multi-turn, gateway-overhead and two-worker lines and the load averages."""

from __future__ import annotations

import argparse

LABEL = {
    "default": "Omni-Flow, 2 llm workers",
    "one": "Omni-Flow, 1 llm worker",
    "vllm-engine": "Omni-Flow gateway + vLLM engine",
    "vllm": "vLLM's server",
}


def _fmt(v: float | None, spec: str = "{:.1f}") -> str:
    return "-" if v is None or v != v else spec.format(v)


def level_rows(res: dict, names: list[str], args: argparse.Namespace, kind: str) -> list[str]:
    """The issue's rows: per Omni-Flow system and level, ours / vLLM's server."""
    rows = [("system", "concurrency", "TTFT p50 ours / vLLM ms", "TTFT p99 ours / vLLM ms",
             "ITL p50 ours / vLLM ms", "output tok/s ours / vLLM")]  # fmt: skip
    ref = res.get("vllm", {})
    for name in names:
        if name == "vllm":
            continue
        for conc in args.concurrency:
            a = res.get(name, {}).get(f"c{conc}", {}).get(kind, {})
            b = ref.get(f"c{conc}", {}).get(kind, {})

            def pair(key: str, a: dict = a, b: dict = b) -> str:
                return f"{_fmt(a.get(key))} / {_fmt(b.get(key))}"

            ta, tb = a.get("tok_s"), b.get("tok_s")
            ratio = f" ({ta / tb:.2f}x)" if ta is not None and tb else ""
            rows.append((LABEL[name], str(conc), pair("ttft_p50"), pair("ttft_p99"),
                         pair("itl_p50"), pair("tok_s") + ratio))  # fmt: skip
            if kind == "aiperf" and a:
                n = "{:.0f}"
                rows.append((
                    "", "",
                    f"completion tokens {_fmt(a.get('completion_min'), n)}-"
                    f"{_fmt(a.get('completion_max'), n)} / {_fmt(b.get('completion_min'), n)}-"
                    f"{_fmt(b.get('completion_max'), n)}",
                    f"errors {_fmt(a.get('errors'), n)} / {_fmt(b.get('errors'), n)}", "", "",
                ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def table(res: dict, names: list[str], over: dict | None, loads: list[str], args) -> str:
    lines: list[str] = []
    if args.aiperf:
        lines += [f"aiperf: streamed chat, {args.aiperf_isl} prompt tokens, {args.aiperf_osl} "
                  "out (ignore_eos), interleaved level by level", *level_rows(
                      res, names, args, "aiperf"), ""]  # fmt: skip
    if "load" in args.parts:
        lines += [f"this script's client (openai SDK): distinct questions, {args.max_tokens} out "
                  "(ignore_eos)", *level_rows(res, names, args, "sdk"), ""]  # fmt: skip
    for work, what in (("chat", "multi-turn"), ("cross", "2 workers: multi-turn")):
        got = {n: res[n][work] for n in res if work in res[n]}
        for n, r in got.items():
            lines.append(
                f"{what} ({LABEL.get(n, n)}): later-turn TTFT p50 {r['ttft_p50']:.1f} ms, "
                f"cached {r['cached_pct']:.1f}%, wall {r['wall_s']:.1f} s"
            )
    if over:
        lines += [
            "",
            "gateway overhead (1-token chat, paired with the worker's gRPC Generate; echo "
            "TEST worker, no compute):",
            f"  one echo worker: TTFT p50 via gateway "
            f"{over['gateway_ttft_p50']:.2f} ms, direct {over['direct_ttft_p50']:.2f} ms; "
            f"added p50 {over['added_p50']:.2f} ms, p90 {over['added_p90']:.2f} ms "
            "(target <= 1 ms p50)",
        ]
        if "added_p50_picked" in over:
            lines.append(
                f"  two echo workers (the gateway's kv_aware pick chooses): TTFT p50 via "
                f"gateway {over['gateway_ttft_p50_picked']:.2f} ms, direct "
                f"{over['direct_ttft_p50_picked']:.2f} ms; added p50 "
                f"{over['added_p50_picked']:.2f} ms, p90 {over['added_p90_picked']:.2f} ms"
            )
        lines += [
            f"  timed alone: the gateway's in-process pick (kv_aware, with the index's prefix "
            f"match) p50 {over['local_pick_p50']:.2f} ms (round_robin "
            f"{over['local_pick_rr_p50']:.2f} ms); the router's Pick (the coordinator's) p50 "
            f"{over['pick_p50']:.2f} ms (round_robin {over['pick_rr_p50']:.2f} ms), "
            f"template+tokenize+hashes p50 {over['tokenize_p50']:.2f} ms, an HTTP round trip "
            f"(GET /health) p50 {over['health_p50']:.2f} ms",
        ]
    if "cross" in args.parts:
        lines += [
            "",
            f"2 workers: turn t of each conversation on worker t % 2, {args.cross_threads} "
            "thread(s) each. Omni-Flow: two nodes (a kv-agent and an llm worker each, one "
            "kv-index), the gateway told the worker by model name; vLLM: two OpenAI servers "
            "with prefix caching, the turns alternating between them (round robin), whose "
            "prefix caches cannot reach each other.",
        ]
    lines += ["", f"load average (1/5/15 min): {' | '.join(loads)}"]
    return "\n".join(lines)
