"""One OpenAI-API load generator against (a) the Omni-Flow gateway and (b) vLLM's own
OpenAI server, the same model folder (SmolLM2-135M-Instruct, bfloat16), prefix caching on
in both; plus what the gateway adds over calling the worker's gRPC Generate directly.

    python bench/serve_openai.py                       # everything (a few minutes)
    python bench/serve_openai.py --concurrency 1,4 --skip-vllm
    python bench/serve_openai.py --parts cross --engine vllm   # two workers, vLLM engine
    python bench/serve_openai.py --parts load --aiperf          # plus aiperf's fixed-length rows

The servers are started by ``serve_stack.py``, this module generates the load and prints
the table. It starts and stops everything itself, by PID: for Omni-Flow a private Redis, kv-index,
kv-agent, router (llm=kv_aware), one llm worker and the gateway; then vLLM's
`vllm.entrypoints.openai.api_server` from its own virtualenv (``--vllm-python``) with
``VLLM_CPU_KVCACHE_SPACE=2``. The two servers run one after the other, each with every
core. Workloads (streamed chat, ``stream_options.include_usage``, greedy):

* load: concurrency 1, 4, 16, ``2 x concurrency`` requests (at least 4) of distinct
  questions, ``--max-tokens`` each: TTFT p50/p99, ITL p50, output tokens/s;
* multi-turn chat: ``--conversations`` concurrent conversations of ``--turns`` turns, each
  turn sending the whole history: TTFT p50 of the later turns and their cached share;
* multi-turn across two workers (``cross``): the same conversations, turn ``t`` on worker
  ``t % 2``. Omni-Flow runs two nodes (a kv-agent and an llm worker each, one kv-index;
  the gateway reaches each worker by a model name of its own, over the same weights), so
  every later turn's prefix must come from the other worker's pages through the agents.
  vLLM's baseline is two of its OpenAI servers with the turns alternating between them
  (round robin): its prefix cache cannot cross servers, so the later turns recompute.
  Each worker or server gets ``--cross-threads`` threads (default half the cores);
* fixed-length rows by aiperf (``--aiperf``; ``aiperf_rows.py``, its own venv from
  ``scripts/setup_aiperf_venv.sh``): per concurrency level, ``--aiperf-requests`` streamed
  chats of ``--aiperf-isl`` synthetic prompt tokens asked for ``--aiperf-osl`` tokens with
  ``ignore_eos``, so both servers write exactly that many: TTFT p50/p99, ITL p50, output
  tok/s, and the output lengths and errors aiperf counted;
* gateway overhead: the same 1-token chat through the gateway (raw HTTP, no SDK) and as
  token ids straight to the worker's ``Generate``, interleaved: the median paired
  difference of time to first token, with the router's Pick and the template+tokenize
  step timed alone for the breakdown. The worker here is the echo TEST worker
  (``omniflow.testing.echo_worker``, no compute: it answers at once), registered as model
  ``echo`` with SmolLM2's tokenizer, so that the model's step time (tens of ms, noisy on
  a shared machine) does not drown the gateway's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiperf_rows
from openai import AsyncOpenAI
from serve_stack import (
    MODEL,
    Omniflow,
    Procs,
    load_avg,
    start_echo,
    start_omniflow,
    start_vllm,
)

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.chat import Preprocessor
from omniflow.rpc.client import open_channel

DEFAULT_VLLM = Path.home() / ".cache/omniflow/venvs/vllm/bin/python"
QUESTIONS = [
    "What is the capital of France?",
    "Explain what a hash table is.",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Give me a tip for writing clean code.",
    "What does a CPU cache do?",
    "How do plants make food?",
    "What is the boiling point of water?",
    "Describe a cat in one sentence.",
    "What is machine learning?",
    "How far is the Moon from Earth?",
    "Suggest a name for a pet fish.",
    "What is the largest ocean?",
    "How do I make a cup of tea?",
    "What is a prime number?",
    "Why do leaves change color in autumn?",
    "What is an API?",
    "Tell me a fun fact about octopuses.",
    "What is the speed of light?",
    "How does a bicycle stay upright?",
]
FOLLOW_UPS = ["Can you say more?", "Give an example.", "Summarize that in one line."]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ------------------------------------------------------------------ load generator


@dataclass
class Sample:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt: int = 0
    cached: int = 0
    text: str = ""


async def one_chat(
    client: AsyncOpenAI, messages: list[dict], max_tokens: int, model: str = MODEL
) -> Sample:
    s = Sample()
    start = time.perf_counter()
    last = None
    parts = []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if last is None:
                s.ttft = now - start
            else:
                s.itl.append(now - last)
            last = now
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            s.tokens = chunk.usage.completion_tokens
            s.prompt = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            s.cached = (details.cached_tokens or 0) if details else 0
    s.text = "".join(parts)
    return s


async def load_level(url: str, conc: int, max_tokens: int, offset: int) -> dict[str, float]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    n = max(4, 2 * conc)
    sem = asyncio.Semaphore(conc)

    async def run(i: int) -> Sample:
        q = QUESTIONS[(offset + i) % len(QUESTIONS)]
        async with sem:
            return await one_chat(client, [{"role": "user", "content": f"{q} ({i})"}], max_tokens)

    start = time.perf_counter()
    samples = await asyncio.gather(*(run(i) for i in range(n)))
    wall = time.perf_counter() - start
    await client.close()
    itl = [x for s in samples for x in s.itl]
    return {
        "ttft_p50": pct([s.ttft for s in samples], 0.5) * 1e3,
        "ttft_p99": pct([s.ttft for s in samples], 0.99) * 1e3,
        "itl_p50": pct(itl, 0.5) * 1e3,
        "tok_s": sum(s.tokens for s in samples) / wall,
    }


async def multi_turn(
    endpoints: list[tuple[str, str]], conversations: int, turns: int, max_tokens: int
) -> dict[str, float]:
    """Conversations of ``turns`` turns, each sending the whole history; turn ``t`` goes
    to ``endpoints[t % len(endpoints)]`` (server URL, model name): with two endpoints on
    two workers, every later turn lands on the worker that did not compute its prefix."""
    clients = [
        (AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600), model)
        for url, model in endpoints
    ]
    later: list[Sample] = []

    async def conversation(c: int) -> None:
        history = [
            {"role": "system", "content": "You are a helpful assistant. Keep answers short."},
            {"role": "user", "content": QUESTIONS[c % len(QUESTIONS)]},
        ]
        for t in range(turns):
            client, model = clients[t % len(clients)]
            s = await one_chat(client, history, max_tokens, model)
            if t:
                later.append(s)
            history += [
                {"role": "assistant", "content": s.text},
                {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]},
            ]

    start = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(conversations)))
    wall = time.perf_counter() - start
    for client, _ in clients:
        await client.close()
    prompt = sum(s.prompt for s in later)
    return {
        "ttft_p50": pct([s.ttft for s in later], 0.5) * 1e3,
        "cached_pct": 100.0 * sum(s.cached for s in later) / prompt if prompt else 0.0,
        "wall_s": wall,
    }


async def overhead(of: Omniflow, folder: Path, samples: int) -> dict[str, float]:
    """Paired TTFT: gateway (HTTP, streamed, 1 token) vs the worker's Generate directly."""
    messages = [{"role": "user", "content": "Hello there!"}]
    pre = Preprocessor.from_folder(folder, bytes.fromhex(of.namespace))
    ids = pre.encode_chat(messages)
    hashes = pre.block_hashes(ids)
    body = {"model": "echo", "messages": messages, "max_tokens": 1, "temperature": 0}
    body["stream"] = True
    channel = open_channel(of.worker, default_timeout_s=60, max_in_flight=None)
    worker = worker_pb2_grpc.WorkerServiceStub(channel)
    rchannel = open_channel(of.router, default_timeout_s=10, max_in_flight=None)
    router = router_pb2_grpc.RouterServiceStub(rchannel)
    sampling = common_pb2.SamplingParams(
        max_tokens=1, temperature=0, stop_token_ids=list(pre.eos_token_ids)
    )

    async def direct() -> float:
        start = time.perf_counter()
        call = worker.Generate(
            worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling),
            timeout=60,
        )
        first = 0.0
        async for r in call:
            if (r.token_ids or r.text) and not first:
                first = time.perf_counter() - start
        return first

    # A minimal HTTP/1.1 client on one kept-alive connection (one write per request, the
    # bytes scanned as they come): an SDK's own parsing is not the gateway's cost.
    host, port = of.url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    conn: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def via_gateway() -> float:
        if not conn:
            conn.append(await asyncio.open_connection(host, int(port)))
        reader, writer = conn[0]
        start = time.perf_counter()
        writer.write(request)
        first = 0.0
        seen = b""
        while not seen.endswith(b"0\r\n\r\n"):  # the last chunk of the chunked body
            data = await reader.read(65536)
            if not data:
                raise RuntimeError("the gateway closed the connection")
            seen += data
            if not first and b'"content":"echo' in seen:
                first = time.perf_counter() - start
        return first

    async def health() -> float:
        reader, writer = conn[0]
        start = time.perf_counter()
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        seen = b""
        while b'"ok"}' not in seen:
            seen += await reader.read(65536)
        return time.perf_counter() - start

    async def pick(strategy: int = router_pb2.STRATEGY_KV_AWARE) -> float:
        start = time.perf_counter()
        await router.Pick(
            router_pb2.PickRequest(
                role="llm",
                operation="generate",
                strategy=strategy,  # type: ignore[arg-type]
                kv_namespace=of.namespace,
                block_hashes=hashes,
                prompt_tokens=len(ids),
            ),
            timeout=5,
        )
        return time.perf_counter() - start

    def tokenize() -> float:
        start = time.perf_counter()
        p = pre.encode_chat(messages)
        pre.block_hashes(p)
        return time.perf_counter() - start

    gw, dr, diff, picks, rr, toks, floor = [], [], [], [], [], [], []
    for _ in range(5):  # warm: connections, caches
        await via_gateway()
        await direct()
    for i in range(samples):
        if i % 2:
            a = await via_gateway()
            b = await direct()
        else:
            b = await direct()
            a = await via_gateway()
        gw.append(a)
        dr.append(b)
        diff.append(a - b)
        picks.append(await pick())
        rr.append(await pick(router_pb2.STRATEGY_ROUND_ROBIN))
        toks.append(tokenize())
        floor.append(await health())
    conn[0][1].close()
    await channel.close()
    await rchannel.close()
    return {
        "gateway_ttft_p50": pct(gw, 0.5) * 1e3,
        "direct_ttft_p50": pct(dr, 0.5) * 1e3,
        "added_p50": pct(diff, 0.5) * 1e3,
        "added_p90": pct(diff, 0.9) * 1e3,
        "pick_p50": pct(picks, 0.5) * 1e3,
        "pick_rr_p50": pct(rr, 0.5) * 1e3,
        "tokenize_p50": pct(toks, 0.5) * 1e3,
        "health_p50": pct(floor, 0.5) * 1e3,
    }


async def workloads(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    # Warm-up: first-call costs (graph capture, allocator, connection) out of the figures.
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    for q in QUESTIONS[:2]:
        await one_chat(client, [{"role": "user", "content": q}], 4)
    await client.close()
    out: dict[str, dict[str, float]] = {}
    for i, conc in enumerate(args.concurrency if "load" in args.parts else ()):
        out[f"c{conc}"] = await load_level(url, conc, args.max_tokens, offset=7 * i)
        print(f"  concurrency {conc}: {out[f'c{conc}']}  (load {load_avg()})", flush=True)
    for conc in args.concurrency if args.aiperf else ():
        row = await asyncio.to_thread(
            aiperf_rows.profile, url, MODEL, args.tokenizer, concurrency=conc,
            requests=args.aiperf_requests, isl=args.aiperf_isl, osl=args.aiperf_osl,
        )  # fmt: skip
        out[f"aiperf c{conc}"] = row.as_dict()
        print(f"  aiperf concurrency {conc}: {row}  (load {load_avg()})", flush=True)
    if "chat" in args.parts:
        out["chat"] = await multi_turn(
            [(url, MODEL)], args.conversations, args.turns, args.chat_max_tokens
        )
        print(f"  multi-turn: {out['chat']}  (load {load_avg()})", flush=True)
    return out


async def cross_workload(
    endpoints: list[tuple[str, str]], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """The multi-turn chat alternating between two workers (after a warm-up on each)."""
    for url, model in endpoints:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
        await one_chat(client, [{"role": "user", "content": QUESTIONS[-1]}], 4, model)
        await client.close()
    out = {
        "cross": await multi_turn(endpoints, args.conversations, args.turns, args.chat_max_tokens)
    }
    print(f"  multi-turn across two workers: {out['cross']}  (load {load_avg()})", flush=True)
    return out


def table(ours: dict, ref: dict, over: dict | None, loads: list[str], args) -> str:
    rows = [("workload", "metric", "omni-flow", "vLLM", "ours/vLLM")]

    def add(work: str, metric: str, key: str, fmt: str = "{:.1f}") -> None:
        a = ours.get(work, {}).get(key)
        b = ref.get(work, {}).get(key)
        ratio = f"{a / b:.2f}x" if a is not None and b else "-"
        rows.append(
            (
                work,
                metric,
                fmt.format(a) if a is not None else "-",
                fmt.format(b) if b is not None else "-",
                ratio,
            )
        )

    for conc in args.concurrency if "load" in args.parts else ():
        w = f"c{conc}"
        add(w, "TTFT p50 ms", "ttft_p50")
        add(w, "TTFT p99 ms", "ttft_p99")
        add(w, "ITL p50 ms", "itl_p50")
        add(w, "output tok/s", "tok_s")
    for conc in args.concurrency if args.aiperf else ():
        w = f"aiperf c{conc}"
        add(w, f"TTFT p50 ms (isl {args.aiperf_isl})", "ttft_p50")
        add(w, "TTFT p99 ms", "ttft_p99")
        add(w, "ITL p50 ms", "itl_p50")
        add(w, f"output tok/s (osl {args.aiperf_osl})", "tok_s")
        add(w, "completion tokens min", "completion_min", "{:.0f}")
        add(w, "completion tokens max", "completion_max", "{:.0f}")
        add(w, "aiperf's length mismatches", "osl_mismatches", "{:.0f}")
        add(w, "errors", "errors", "{:.0f}")
    for work, what in (("chat", ""), ("cross", "2 workers: ")):
        if work in args.parts:
            add(work, f"{what}later-turn TTFT p50 ms", "ttft_p50")
            add(work, f"{what}later-turn cached %", "cached_pct")
            add(work, f"{what}wall s", "wall_s")
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if over:
        lines += [
            "",
            "gateway overhead (1-token chat, paired with the worker's gRPC Generate; echo "
            "TEST worker, no compute):",
            f"  TTFT p50 via gateway {over['gateway_ttft_p50']:.2f} ms, direct "
            f"{over['direct_ttft_p50']:.2f} ms; added p50 {over['added_p50']:.2f} ms, "
            f"p90 {over['added_p90']:.2f} ms (target <= 1 ms p50)",
            f"  of which: router Pick (kv_aware, with the index's prefix match) p50 "
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


PARTS = ("load", "chat", "overhead", "cross")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--concurrency", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")]
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--chat-max-tokens", type=int, default=24)
    ap.add_argument("--overhead-samples", type=int, default=40)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--cross-threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 2),
        help="threads of each of the two workers (or vLLM servers) of the cross part",
    )
    ap.add_argument(
        "--parts",
        default=",".join(PARTS),
        type=lambda s: [x for x in s.split(",") if x],
        help=f"which workloads, of {','.join(PARTS)}",
    )
    ap.add_argument("--aiperf", action="store_true", help="add aiperf's fixed-length rows")
    ap.add_argument("--aiperf-isl", type=int, default=128, help="aiperf prompt tokens")
    ap.add_argument("--aiperf-osl", type=int, default=32, help="aiperf output tokens (exact)")
    ap.add_argument("--aiperf-requests", type=int, default=16, help="per concurrency level")
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default="torch",
        help="the engine behind the Omni-Flow gateway: built-in, or vLLM's (from --vllm-python)",
    )
    ap.add_argument("--skip-omniflow", action="store_true", help="vLLM only")
    ap.add_argument("--models-dir", type=Path, default=Path("~/.cache/omniflow/models"))
    args = ap.parse_args()
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; accepted: {','.join(PARTS)}")

    from omniflow.models.resolve import resolve_model

    folder = resolve_model(MODEL, args.models_dir.expanduser())
    args.tokenizer = folder  # aiperf's synthetic prompts are counted in the model's tokens
    if args.aiperf and aiperf_rows.find_aiperf() is None:
        ap.error(
            f"--aiperf: no aiperf at {aiperf_rows.DEFAULT_AIPERF}; scripts/setup_aiperf_venv.sh"
        )
    single = bool({"load", "chat", "overhead"} & set(args.parts))
    loads = [f"start {load_avg()}"]
    ours: dict = {}
    ref: dict = {}
    over = None
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-serve-bench-"))
    procs = Procs(tmp)
    redis = None

    def stop() -> None:
        nonlocal redis
        procs.stop()  # the topology running now (the cross part starts its own)
        if redis is not None:
            redis.stop()  # type: ignore[attr-defined]
            redis = None

    try:
        if not args.skip_omniflow and single:
            print(
                f"Omni-Flow gateway ({folder}, bfloat16, {args.threads} threads, "
                f"engine {args.engine}) ..."
            )
            of, redis = start_omniflow(procs, folder, args.threads, args.engine, args.vllm_python)
            ours = asyncio.run(workloads(of.url, args))
            if "overhead" in args.parts:
                over = asyncio.run(overhead(start_echo(procs, of), folder, args.overhead_samples))
                print(f"  overhead: {over}", flush=True)
            loads.append(f"after omni-flow {load_avg()}")
            stop()
        if not args.skip_omniflow and "cross" in args.parts:
            print(f"Omni-Flow, two nodes (engine {args.engine}, {args.cross_threads} threads each)")
            (tmp / "cross").mkdir()
            procs = Procs(tmp / "cross")  # a run folder of its own: no state of the first
            nodes = ("node-a", "node-b")
            of, redis = start_omniflow(
                procs, folder, args.cross_threads, args.engine, args.vllm_python, nodes
            )
            ours |= asyncio.run(cross_workload([(of.url, of.models[n]) for n in nodes], args))
            loads.append(f"after omni-flow 2 workers {load_avg()}")
            stop()
        if not args.skip_vllm:
            if not args.vllm_python.exists():
                print(f"no vLLM at {args.vllm_python}: skipped (scripts/setup_vllm_venv.sh)")
            else:
                if single:
                    print("vLLM OpenAI server ...", flush=True)
                    url = start_vllm(procs, folder, args.vllm_python, args.threads)
                    ref = asyncio.run(workloads(url, args))
                    loads.append(f"after vLLM {load_avg()}")
                    stop()
                if "cross" in args.parts:
                    print("two vLLM OpenAI servers, round robin ...", flush=True)
                    urls = [
                        start_vllm(procs, folder, args.vllm_python, args.cross_threads, name)
                        for name in ("vllm-a", "vllm-b")
                    ]
                    ref |= asyncio.run(cross_workload([(u, MODEL) for u in urls], args))
                    loads.append(f"after vLLM 2 servers {load_avg()}")
    finally:
        stop()
    print()
    print(table(ours, ref, over, loads, args))
    print(f"\nlogs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
