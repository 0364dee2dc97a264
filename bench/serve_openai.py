"""One OpenAI-API load generator against Omni-Flow's gateway (the default topology's two llm
workers, one llm worker, and vLLM's engine behind the gateway) and vLLM's own OpenAI server,
the same model folder (SmolLM2-135M-Instruct, bfloat16), prefix caching on in all; plus what
the gateway adds over calling the worker's gRPC Generate directly.

    python bench/serve_openai.py                       # the whole table (<= 15 min, quiet)
    python bench/serve_openai.py --concurrency 1,4 --aiperf-requests 4 --requests 4 \
        --systems one,vllm --parts load,overhead --overhead-samples 10   # a 2-minute smoke
    python bench/serve_openai.py --parts cross --engine vllm   # two workers, vLLM engine

Interleaved, level by level: every system of ``--systems`` is started first and stays up
(an idle server costs nothing here: no step runs without a request), then each concurrency
level runs on each system in turn, the order rotated from level to level, so that a slow
minute of a shared machine falls on all of them alike; each system has every core while it
runs. The systems (``serve_stack.py`` starts and stops them, by PID, each in a run folder of
its own):

* ``default``: Omni-Flow as ``omniflow up`` sizes it: two llm workers with half the cores
  each (``--threads`` split), kv_aware router, kv-index, kv-agent, private Redis, gateway;
* ``one``: the same with one llm worker of ``--threads`` threads;
* ``vllm-engine``: one llm worker hosting vLLM's engine (``OMNIFLOW_WORKER_ENGINE=vllm``,
  run from vLLM's virtualenv, its KV connector storing pages at the kv-agent);
* ``vllm``: vLLM's ``vllm.entrypoints.openai.api_server`` from ``--vllm-python`` with
  ``VLLM_CPU_KVCACHE_SPACE=2``.

Load per level (concurrency 1, 4, 16): aiperf (``aiperf_rows.py``, its own venv from
``scripts/setup_aiperf_venv.sh``; ``--no-aiperf`` leaves it out) sends streamed chats of
``--aiperf-isl`` (256) synthetic prompt tokens asked for ``--aiperf-osl`` (64) tokens with
``ignore_eos``, so every server writes exactly that many: TTFT p50/p99, ITL p50, output tok/s
and the lengths and errors aiperf counted; beside it this script's own client (the
``openai`` SDK, ``stream_options.include_usage``, greedy, ``ignore_eos``, ``--max-tokens``
each, ``max(--requests, 2 x concurrency)`` distinct questions). The table gives, per system
and level, ours / vLLM's server as the issue's rows do. Then, one system after another:

* multi-turn chat (``chat``): ``--conversations`` concurrent conversations of ``--turns``
  turns, each turn sending the whole history: TTFT p50 of the later turns, cached share;
* multi-turn across two workers (``cross``): the same conversations, turn ``t`` on worker
  ``t % 2``. Omni-Flow runs two nodes (a kv-agent and an llm worker each, one kv-index;
  the gateway reaches each worker by a model name of its own, over the same weights), so
  every later turn's prefix must come from the other worker's pages through the agents.
  vLLM's baseline is two of its OpenAI servers with the turns alternating between them
  (round robin): its prefix cache cannot cross servers, so the later turns recompute.
  Each worker or server gets ``--cross-threads`` threads (default half the cores);
* gateway overhead: the same 1-token chat through the gateway (raw HTTP, no SDK) and as
  token ids straight to the worker's ``Generate``, interleaved: the median paired
  difference of time to first token, with the pick (as the gateway makes it, in its own
  process: ``omniflow.routing.picker``, kv_aware with the index's prefix match), the
  router's Pick (the coordinator's path) and the template+tokenize step timed alone for
  the breakdown. The worker here is the echo TEST worker (no compute: it answers at once),
  registered as model ``echo`` with SmolLM2's tokenizer, so that the model's step time
  (tens of ms, noisy on a shared machine) does not drown the gateway's own cost. Twice:
  with one echo worker and with two (the model has a choice: the kv_aware pick decides).
  ``bench/serve_breakdown.py`` times every step of one request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
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
    Running,
    load_avg,
    start_echo,
    start_omniflow,
    start_system,
    start_vllm,
)
from serve_table import LABEL, table

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.chat import Preprocessor
from omniflow.config import load_settings
from omniflow.discovery import find_address, make_registry
from omniflow.routing.picker import Picker
from omniflow.routing.settings import PickSettings
from omniflow.rpc.client import open_channel
from omniflow.workers import WORKER_SERVICE, worker_from_instance

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
    client: AsyncOpenAI,
    messages: list[dict],
    max_tokens: int,
    model: str = MODEL,
    ignore_eos: bool = False,
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
        extra_body={"ignore_eos": True} if ignore_eos else None,
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


async def load_level(
    url: str, conc: int, max_tokens: int, offset: int, requests: int = 4
) -> dict[str, float]:
    """``max(requests, 2 x conc)`` distinct questions, ``conc`` at once, each answer exactly
    ``max_tokens`` long (``ignore_eos``)."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    n = max(requests, 2 * conc)
    sem = asyncio.Semaphore(conc)

    async def run(i: int) -> Sample:
        q = QUESTIONS[(offset + i) % len(QUESTIONS)]
        msgs = [{"role": "user", "content": f"{q} ({offset}.{i})"}]
        async with sem:
            return await one_chat(client, msgs, max_tokens, ignore_eos=True)

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

    # The gateway's pick, made here as the gateway makes it (its settings: the topology's
    # env, so the same way to the index), over the same discovery listing.
    registry = make_registry("redis", url=of.base["OMNIFLOW_REDIS_URL"], timeout_s=5.0)
    picker = Picker(load_settings(PickSettings, env=of.base))
    picker.open_index(lambda: find_address(registry, "kv-index"))
    picker.table.replace(worker_from_instance(i) for i in await registry.list(WORKER_SERVICE))
    namespace = bytes.fromhex(of.namespace)

    async def local_pick(strategy: str = "kv_aware") -> float:
        start = time.perf_counter()
        r = await picker.pick("llm", strategy, namespace=namespace, hashes=hashes)
        picker.table.finish(r.worker.worker_id, picker.table.begin(r.worker.worker_id), True)
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
    local, local_rr = [], []
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
        local.append(await local_pick())
        local_rr.append(await local_pick("round_robin"))
        toks.append(tokenize())
        floor.append(await health())
    conn[0][1].close()
    await channel.close()
    await rchannel.close()
    await picker.close()
    await registry.close()
    return {
        "gateway_ttft_p50": pct(gw, 0.5) * 1e3,
        "direct_ttft_p50": pct(dr, 0.5) * 1e3,
        "added_p50": pct(diff, 0.5) * 1e3,
        "added_p90": pct(diff, 0.9) * 1e3,
        "pick_p50": pct(picks, 0.5) * 1e3,
        "pick_rr_p50": pct(rr, 0.5) * 1e3,
        "local_pick_p50": pct(local, 0.5) * 1e3,
        "local_pick_rr_p50": pct(local_rr, 0.5) * 1e3,
        "tokenize_p50": pct(toks, 0.5) * 1e3,
        "health_p50": pct(floor, 0.5) * 1e3,
    }


SYSTEMS = ("default", "one", "vllm-engine", "vllm")


async def warm(url: str) -> None:
    """First-call costs (compilation, allocator, connection) out of the figures."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=900)
    for q in QUESTIONS[:2]:
        await one_chat(client, [{"role": "user", "content": q}], 8, ignore_eos=True)
    await client.close()


def level_on(
    url: str, conc: int, args: argparse.Namespace, offset: int, artifacts: Path
) -> dict[str, dict]:
    """One concurrency level on one server: this script's client, then aiperf (its files
    under ``artifacts``, in the run folder)."""
    out: dict[str, dict] = {}
    if "load" in args.parts:
        out["sdk"] = asyncio.run(load_level(url, conc, args.max_tokens, offset, args.requests))
    if args.aiperf:
        row = aiperf_rows.profile(
            url, MODEL, args.tokenizer, concurrency=conc,
            requests=max(args.aiperf_requests, 2 * conc), isl=args.aiperf_isl,
            osl=args.aiperf_osl, artifacts=artifacts,
        )  # fmt: skip
        out["aiperf"] = row.as_dict()
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


PARTS = ("load", "chat", "overhead", "cross")


def main() -> int:
    # SIGTERM (a `timeout`, a CI cancel) unwinds like Ctrl-C, so every server started is
    # stopped by its PID on the way out (a bare SIGTERM left them all running).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--concurrency", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")]
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="own client's output tokens")
    ap.add_argument("--requests", type=int, default=8, help="own client's requests per level")
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
        default="load,overhead",
        type=lambda s: [x for x in s.split(",") if x],
        help=f"which workloads, of {','.join(PARTS)} (aiperf's rows: --no-aiperf)",
    )
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        type=lambda s: [x for x in s.split(",") if x],
        help=f"which servers, of {','.join(SYSTEMS)}",
    )
    ap.add_argument("--no-aiperf", dest="aiperf", action="store_false", help="no aiperf rows")
    ap.add_argument("--aiperf-isl", type=int, default=256, help="aiperf prompt tokens")
    ap.add_argument("--aiperf-osl", type=int, default=64, help="aiperf output tokens (exact)")
    ap.add_argument(
        "--aiperf-requests", type=int, default=16, help="per level (at least 2 x concurrency)"
    )
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    ap.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default="torch",
        help="the engine behind the gateway in the cross part: built-in, or vLLM's",
    )
    ap.add_argument("--models-dir", type=Path, default=Path("~/.cache/omniflow/models"))
    args = ap.parse_args()
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; accepted: {','.join(PARTS)}")
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(set(args.systems) - set(SYSTEMS))}; accepted: "
                 f"{','.join(SYSTEMS)}")  # fmt: skip

    from omniflow.models.resolve import resolve_model

    folder = resolve_model(MODEL, args.models_dir.expanduser())
    args.tokenizer = folder  # aiperf's synthetic prompts are counted in the model's tokens
    if args.aiperf and aiperf_rows.find_aiperf() is None:
        ap.error(f"no aiperf at {aiperf_rows.DEFAULT_AIPERF}: scripts/setup_aiperf_venv.sh "
                 "(or --no-aiperf)")  # fmt: skip
    names = list(args.systems)
    if not args.vllm_python.exists():
        print(f"no vLLM at {args.vllm_python}: vllm and vllm-engine skipped "
              "(scripts/setup_vllm_venv.sh)")  # fmt: skip
        names = [n for n in names if n not in ("vllm", "vllm-engine")]
    loads = [f"start {load_avg()}"]
    res: dict[str, dict] = {n: {} for n in names}
    over = None
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-serve-bench-"))
    up: list[Running] = []
    try:
        if {"load", "chat", "overhead"} & set(args.parts) or args.aiperf:
            for name in names:
                print(f"starting {LABEL[name]} ({folder}, bfloat16) ...", flush=True)
                up.append(start_system(name, tmp, folder, args.threads, args.vllm_python))
                asyncio.run(warm(up[-1].url))
            loads.append(f"all up {load_avg()}")
            for li, conc in enumerate(args.concurrency if ("load" in args.parts or
                                                           args.aiperf) else ()):  # fmt: skip
                order = up[li % len(up) :] + up[: li % len(up)]  # rotated per level
                for sys_ in order:
                    files = tmp / sys_.name / f"aiperf-c{conc}"
                    got = level_on(sys_.url, conc, args, 7 * li, files)
                    res[sys_.name][f"c{conc}"] = got
                    print(f"  {LABEL[sys_.name]}, concurrency {conc}: {got}  "
                          f"(load {load_avg()})", flush=True)  # fmt: skip
                loads.append(f"after concurrency {conc} {load_avg()}")
            for sys_ in up if "chat" in args.parts else ():
                chat = multi_turn(
                    [(sys_.url, MODEL)], args.conversations, args.turns, args.chat_max_tokens
                )
                res[sys_.name]["chat"] = asyncio.run(chat)
                print(f"  {LABEL[sys_.name]} multi-turn: {res[sys_.name]['chat']}", flush=True)
            ours = [r for r in up if r.of is not None and r.name != "vllm-engine"]
            if "overhead" in args.parts and ours:
                of = start_echo(ours[-1].procs, ours[-1].of)
                over = asyncio.run(overhead(of, folder, args.overhead_samples))
                print(f"  overhead, one echo worker: {over}", flush=True)
                # A second echo worker: the model has a choice (the kv_aware pick decides).
                start_echo(ours[-1].procs, ours[-1].of, "echo-2")
                two = asyncio.run(overhead(of, folder, args.overhead_samples))
                print(f"  overhead, two echo workers: {two}", flush=True)
                over |= {f"{k}_picked": v for k, v in two.items()}
        for r in up:
            r.stop()
        up.clear()
        if "cross" in args.parts:
            cross_part(res, tmp, folder, args, loads)
    finally:
        for r in up:
            r.stop()
    print()
    print(table(res, names, over, loads, args))
    print(f"\nlogs: {tmp}")
    return 0


def cross_part(res: dict, tmp: Path, folder: Path, args, loads: list[str]) -> None:
    """Two workers (or two vLLM servers), one system after the other."""
    print(f"Omni-Flow, two nodes (engine {args.engine}, {args.cross_threads} threads each)")
    (tmp / "cross").mkdir()
    procs = Procs(tmp / "cross")
    redis = None
    try:
        nodes = ("node-a", "node-b")
        of, redis = start_omniflow(
            procs, folder, args.cross_threads, args.engine, args.vllm_python, nodes
        )
        got = asyncio.run(cross_workload([(of.url, of.models[n]) for n in nodes], args))
        res.setdefault("one", {})["cross"] = got["cross"]
        loads.append(f"after omni-flow 2 workers {load_avg()}")
    finally:
        procs.stop()
        if redis is not None:
            redis.stop()  # type: ignore[attr-defined]
    if "vllm" not in args.systems or not args.vllm_python.exists():
        return
    print("two vLLM OpenAI servers, round robin ...", flush=True)
    (tmp / "cross-vllm").mkdir()
    procs = Procs(tmp / "cross-vllm")
    try:
        urls = [
            start_vllm(procs, folder, args.vllm_python, args.cross_threads, name)
            for name in ("vllm-a", "vllm-b")
        ]
        got = asyncio.run(cross_workload([(u, MODEL) for u in urls], args))
        res.setdefault("vllm", {})["cross"] = got["cross"]
        loads.append(f"after vLLM 2 servers {load_avg()}")
    finally:
        procs.stop()


if __name__ == "__main__":
    sys.exit(main())
