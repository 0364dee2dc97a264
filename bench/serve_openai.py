"""One OpenAI-API load generator against (a) the Omni-Flow gateway and (b) vLLM's own
OpenAI server, the same model folder (SmolLM2-135M-Instruct, bfloat16), prefix caching on
in both; plus what the gateway adds over calling the worker's gRPC Generate directly.

    python bench/serve_openai.py                       # everything (a few minutes)
    python bench/serve_openai.py --concurrency 1,4 --skip-vllm

It starts and stops everything itself, by PID: for Omni-Flow a private Redis, kv-index,
kv-agent, router (llm=kv_aware), one llm worker and the gateway; then vLLM's
`vllm.entrypoints.openai.api_server` from its own virtualenv (``--vllm-python``) with
``VLLM_CPU_KVCACHE_SPACE=2``. The two servers run one after the other, each with every
core. Workloads (streamed chat, ``stream_options.include_usage``, greedy):

* load: concurrency 1, 4, 16, ``2 x concurrency`` requests (at least 4) of distinct
  questions, ``--max-tokens`` each: TTFT p50/p99, ITL p50, output tokens/s;
* multi-turn chat: ``--conversations`` concurrent conversations of ``--turns`` turns, each
  turn sending the whole history: TTFT p50 of the later turns and their cached share;
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
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.chat import Preprocessor
from omniflow.localredis import start_redis
from omniflow.rpc.client import open_channel

MODEL = "smollm2-135m-instruct"
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


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ processes


class Procs:
    """Processes started by the bench, ended by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.started: list[subprocess.Popen[bytes]] = []

    def spawn(self, argv: list[str], name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.started.append(proc)
        return proc

    def service(
        self,
        module: str,
        name: str,
        env: dict[str, str],
        timeout_s: float = 300,
        python: str = sys.executable,
    ) -> dict:
        ready = self.dir / f"{name}.ready"
        full = {
            **os.environ,
            "OMNIFLOW_PORT": "0",
            "OMNIFLOW_METRICS_PORT": "-1",
            "OMNIFLOW_READY_FILE": str(ready),
            "OMNIFLOW_INSTANCE_ID": name,
            "OMNIFLOW_LOG_LEVEL": "WARNING",
            "OMNIFLOW_NODE_ID": "bench",
            **env,
        }
        proc = self.spawn([python, "-m", module], name, full)
        end = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{name} did not start; see {self.dir / (name + '.log')}")
            time.sleep(0.05)
        return json.loads(ready.read_text())

    def stop(self) -> None:
        for p in reversed(self.started):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.started):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.started.clear()


@dataclass
class Omniflow:
    url: str
    worker: str
    router: str
    namespace: str
    base: dict[str, str]


def start_omniflow(
    procs: Procs, folder: Path, threads: int, engine: str = "torch", vllm_python: Path | None = None
) -> tuple[Omniflow, object]:
    """The topology behind the gateway; ``engine`` "vllm" hosts vLLM's engine in the worker
    (run from vLLM's own virtualenv, as ``OMNIFLOW_WORKER_PYTHON`` does in ``omniflow up``)."""
    redis = start_redis(dir=procs.dir / "redis")
    base = {"OMNIFLOW_REDIS_URL": redis.url, "OMNIFLOW_DISCOVERY": "redis"}
    index = procs.service("omniflow_services.kv_index", "kv-index", base)["address"]
    agent = procs.service(
        "omniflow_services.kv_agent",
        "kv-agent",
        {
            **base,
            "OMNIFLOW_KV_INDEX_ADDR": index,
            "OMNIFLOW_KV_HOST_BYTES": str(256 * 1024 * 1024),
            "OMNIFLOW_KV_SSD_PATH": str(procs.dir / "ssd.bin"),
            "OMNIFLOW_KV_SSD_BYTES": str(64 * 1024 * 1024),
        },
    )["address"]
    router = procs.service(
        "omniflow_services.router",
        "router",
        {
            **base,
            "OMNIFLOW_ROUTER_ROLE_STRATEGIES": "llm=kv_aware",
            "OMNIFLOW_KV_INDEX_ADDR": index,
        },
    )["address"]
    worker_env = {
        **base,
        "OMNIFLOW_WORKER_ROLE": "llm",
        "OMNIFLOW_WORKER_MODEL": str(folder),
        "OMNIFLOW_WORKER_DTYPE": "bfloat16",
        "OMNIFLOW_KV_AGENT_ADDR": agent,
        "OMNIFLOW_WORKER_TORCH_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
    }
    python = sys.executable
    if engine == "vllm":
        if vllm_python is None or not vllm_python.exists():
            raise RuntimeError(f"--engine vllm needs vLLM's venv ({vllm_python}): run "
                               "scripts/setup_vllm_venv.sh")  # fmt: skip
        python = str(vllm_python)
        worker_env |= {"OMNIFLOW_WORKER_ENGINE": "vllm", "VLLM_CPU_KVCACHE_SPACE": "2"}
    worker = procs.service(
        "omniflow_services.worker", "llm-1", worker_env, timeout_s=900, python=python
    )
    # The echo worker's model ("echo") resolves to SmolLM2's folder in the gateway.
    models = procs.dir / "models"
    models.mkdir()
    (models / "echo").symlink_to(folder)
    gw = procs.service(
        "omniflow_services.gateway",
        "gateway",
        {
            **base,
            "OMNIFLOW_GATEWAY_PORT": "0",
            "OMNIFLOW_ROUTER_ADDR": router,
            "OMNIFLOW_MODELS_DIR": str(models),
        },
    )
    ns = worker["metadata"]["kv_namespace"]
    return Omniflow(gw["url"], worker["address"], router, ns, base), redis


def start_echo(procs: Procs, of: Omniflow) -> Omniflow:
    """An echo TEST worker (answers at once) on the same topology, for the overhead."""
    echo = procs.service(
        "omniflow.testing.echo_worker",
        "echo-1",
        {**of.base, "OMNIFLOW_WORKER_ROLE": "llm", "OMNIFLOW_ECHO_TOKEN_DELAY_MS": "0"},
    )
    time.sleep(1.5)  # the gateway's and router's discovery listings see it
    ns = echo["metadata"]["kv_namespace"]
    return Omniflow(of.url, echo["address"], of.router, ns, of.base)


def start_vllm(procs: Procs, folder: Path, python: Path, threads: int) -> str:
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": str(threads),
    }
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", MODEL, "--dtype", "bfloat16",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    proc = procs.spawn(argv, "vllm", env)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 900
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited; see {procs.dir / 'vllm.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM not up after 900 s; see {procs.dir / 'vllm.log'}")


# ------------------------------------------------------------------ load generator


@dataclass
class Sample:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt: int = 0
    cached: int = 0
    text: str = ""


async def one_chat(client: AsyncOpenAI, messages: list[dict], max_tokens: int) -> Sample:
    s = Sample()
    start = time.perf_counter()
    last = None
    parts = []
    stream = await client.chat.completions.create(
        model=MODEL,
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


async def multi_turn(url: str, conversations: int, turns: int, max_tokens: int) -> dict[str, float]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    later: list[Sample] = []

    async def conversation(c: int) -> None:
        history = [
            {"role": "system", "content": "You are a helpful assistant. Keep answers short."},
            {"role": "user", "content": QUESTIONS[c % len(QUESTIONS)]},
        ]
        for t in range(turns):
            s = await one_chat(client, history, max_tokens)
            if t:
                later.append(s)
            history += [
                {"role": "assistant", "content": s.text},
                {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]},
            ]

    start = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(conversations)))
    wall = time.perf_counter() - start
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
    for i, conc in enumerate(args.concurrency):
        out[f"c{conc}"] = await load_level(url, conc, args.max_tokens, offset=7 * i)
        print(f"  concurrency {conc}: {out[f'c{conc}']}  (load {load_avg()})", flush=True)
    out["chat"] = await multi_turn(url, args.conversations, args.turns, args.chat_max_tokens)
    print(f"  multi-turn: {out['chat']}  (load {load_avg()})", flush=True)
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

    for conc in args.concurrency:
        w = f"c{conc}"
        add(w, "TTFT p50 ms", "ttft_p50")
        add(w, "TTFT p99 ms", "ttft_p99")
        add(w, "ITL p50 ms", "itl_p50")
        add(w, "output tok/s", "tok_s")
    add("chat", "later-turn TTFT p50 ms", "ttft_p50")
    add("chat", "later-turn cached %", "cached_pct")
    add("chat", "wall s", "wall_s")
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
    lines += ["", f"load average (1/5/15 min): {' | '.join(loads)}"]
    return "\n".join(lines)


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

    from omniflow.models.resolve import resolve_model

    folder = resolve_model(MODEL, args.models_dir.expanduser())
    loads = [f"start {load_avg()}"]
    ours: dict = {}
    ref: dict = {}
    over = None
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-serve-bench-"))
    procs = Procs(tmp)
    redis = None
    try:
        if not args.skip_omniflow:
            print(
                f"Omni-Flow gateway ({folder}, bfloat16, {args.threads} threads, "
                f"engine {args.engine}) ..."
            )
            of, redis = start_omniflow(procs, folder, args.threads, args.engine, args.vllm_python)
            ours = asyncio.run(workloads(of.url, args))
            over = asyncio.run(overhead(start_echo(procs, of), folder, args.overhead_samples))
            print(f"  overhead: {over}", flush=True)
            loads.append(f"after omni-flow {load_avg()}")
            procs.stop()
            redis.stop()  # type: ignore[attr-defined]
            redis = None
        if not args.skip_vllm:
            if not args.vllm_python.exists():
                print(f"no vLLM at {args.vllm_python}: skipped (scripts/setup_vllm_venv.sh)")
            else:
                print("vLLM OpenAI server ...", flush=True)
                url = start_vllm(procs, folder, args.vllm_python, args.threads)
                ref = asyncio.run(workloads(url, args))
                loads.append(f"after vLLM {load_avg()}")
    finally:
        procs.stop()
        if redis is not None:
            redis.stop()  # type: ignore[attr-defined]
    print()
    print(table(ours, ref, over, loads, args))
    print(f"\nlogs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
