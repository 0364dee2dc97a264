"""vLLM's engine inside the Omni-Flow worker against vLLM's own OpenAI server (issue 19 item 4),
paired and interleaved in one run, to find where the worker loses: the same token-id prompts
(``--prompt-tokens`` distinct random ids each, no prefix shared), exactly ``--max-tokens``
out (``ignore_eos``, greedy), streamed.

    python bench/vllm_engine.py --requests 12 --concurrency 1,4     # the paired table
    python bench/vllm_engine.py --requests 2 --concurrency 1 --systems vllm,direct   # smoke

The systems, each started once and up for the whole run (``serve_stack.py``, by PID, in a
run folder of its own):

* ``vllm``: vLLM's ``vllm.entrypoints.openai.api_server``, streamed ``/v1/completions``;
* ``direct-off``: one worker with ``OMNIFLOW_WORKER_ENGINE=vllm`` and the KV connector off
  (``OMNIFLOW_WORKER_KV_CONNECT=false``: no pages stored), its gRPC ``Generate`` called with
  the token ids directly (in a discovery of its own, so the gateway never picks it);
* ``direct``: the same worker with the connector on (pages stored at the kv-agent), in the
  ``vllm-engine`` topology of ``serve_openai.py``, its ``Generate`` called directly;
* ``gateway``: that topology through its gateway, streamed ``/v1/completions``.

Per level and system: TTFT p50, ITL p50 (the gaps between streamed chunks, per token) and
output tokens/s (all tokens of the level over its wall time), then each system's tokens/s
over vLLM's server's. Every HTTP system is called by the same client (httpx, one kept-alive
connection per stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_stack import MODEL, Procs, load_avg, start_omniflow, start_vllm, vllm_import_path

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.localredis import start_redis
from omniflow.rpc.client import open_channel

SYSTEMS = ("vllm", "direct-off", "direct", "gateway")
VLLM_PYTHON = Path("~/.cache/omniflow/venvs/vllm/bin/python").expanduser()


class Stream:
    """One streamed request: seconds to the first token, gaps per token after it."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = self.start
        self.first = 0.0
        self.gaps: list[float] = []
        self.tokens = 0

    def got(self, n: int) -> None:
        now = time.perf_counter()
        if n <= 0:
            return
        if not self.tokens:
            self.first = now - self.start
        else:
            self.gaps.extend([(now - self.last) / n] * n)
        self.last, self.tokens = now, self.tokens + n


async def http_call(client: httpx.AsyncClient, url: str, ids: list[int], n: int) -> Stream:
    body = {
        "model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    s = Stream()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            # One chunk per step with text (a text-less chunk is a held-back partial character).
            if chunk["choices"] and chunk["choices"][0].get("text"):
                s.got(1)
    return s


async def grpc_call(stub, ids: list[int], n: int) -> Stream:
    sampling = common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    req = worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling)
    s = Stream()
    async for r in stub.Generate(req, timeout=600):
        s.got(len(r.token_ids))
    return s


async def level(call, prompts: list[list[int]], conc: int, n: int) -> dict[str, float]:
    todo = iter(prompts)
    done: list[Stream] = []

    async def lane() -> None:
        for ids in todo:
            done.append(await call(ids, n))

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(conc)))
    wall = time.perf_counter() - start
    gaps = [g for s in done for g in s.gaps]
    return {
        "ttft_ms": 1000 * statistics.median(s.first for s in done),
        "itl_ms": 1000 * statistics.median(gaps) if gaps else 0.0,
        "itl_mean_ms": 1000 * statistics.fmean(gaps) if gaps else 0.0,
        "e2e_ms": 1000 * statistics.median(s.last - s.start for s in done),
        "tok_s": sum(s.tokens for s in done) / wall,
        "tokens": sum(s.tokens for s in done) / len(done),
    }


def start(
    name: str, root: Path, folder: Path, threads: int, env: dict[str, str]
) -> tuple[Procs, str, object]:
    """(its processes, its address: a URL or a gRPC address, its Redis or None); ``env``
    reaches the worker processes (``--worker-env``), never vLLM's own server."""
    (root / name).mkdir()
    procs = Procs(root / name)
    if name == "vllm":
        return procs, start_vllm(procs, folder, VLLM_PYTHON, threads), None
    if name == "direct-off":
        redis = start_redis(dir=procs.dir / "redis")
        info = procs.service(
            "omniflow_services.worker",
            "llm-off",
            {
                "OMNIFLOW_REDIS_URL": redis.url,
                "OMNIFLOW_DISCOVERY": "redis",
                "OMNIFLOW_WORKER_ENGINE": "vllm",
                "VLLM_CPU_KVCACHE_SPACE": "2",
                "OMNIFLOW_WORKER_KV_CONNECT": "false",
                "OMNIFLOW_WORKER_ROLE": "llm",
                "OMNIFLOW_WORKER_MODEL": str(folder),
                "OMNIFLOW_WORKER_DTYPE": "bfloat16",
                "OMNIFLOW_WORKER_TORCH_THREADS": str(threads),
                "OMP_NUM_THREADS": str(threads),
                **vllm_import_path(procs.dir / "pythonpath"),
                **env,
            },
            timeout_s=900,
            python=str(VLLM_PYTHON),
        )
        return procs, info["address"], redis
    saved = dict(os.environ)
    os.environ.update(env)  # start_omniflow's services inherit it
    try:
        of, redis = start_omniflow(procs, folder, threads, "vllm", VLLM_PYTHON)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return procs, f"{of.url} {of.worker}", redis


async def run(args: argparse.Namespace, addrs: dict[str, str]) -> dict[int, dict[str, dict]]:
    rng = random.Random(0)
    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64))
    channels, calls = [], {}
    for name, addr in addrs.items():
        if name in ("vllm", "gateway"):
            url = addr.split()[0]
            calls[name] = lambda ids, n, url=url: http_call(http, url, ids, n)
        else:
            ch = open_channel(addr.split()[-1], default_timeout_s=600, max_in_flight=None)
            channels.append(ch)
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            calls[name] = lambda ids, n, stub=stub: grpc_call(stub, ids, n)

    def prompts(k: int) -> list[list[int]]:
        return [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(k)]

    for call in calls.values():  # warm: connections, the first steps
        await level(call, prompts(2), 2, 8)
    out: dict[int, dict[str, dict]] = {}
    names = list(calls)
    for i, conc in enumerate(args.concurrency):
        out[conc] = {}
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotated per level
            r = await level(calls[name], prompts(args.requests), conc, args.max_tokens)
            out[conc][name] = r
            print(f"  c{conc} {name:<10} TTFT {r['ttft_ms']:7.1f} ms  ITL {r['itl_ms']:6.2f} ms "
                  f"(mean {r['itl_mean_ms']:6.2f})  last token {r['e2e_ms']:7.1f} ms  "
                  f"{r['tok_s']:7.1f} tok/s  (load {load_avg()})", flush=True)  # fmt: skip
    await http.aclose()
    for ch in channels:
        await ch.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS))
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--requests", type=int, default=12, help="requests per system and level")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the Omni-Flow processes (repeatable)",
    )
    ap.add_argument("--model", type=Path, default=Path("~/.cache/omniflow/models") / MODEL)
    args = ap.parse_args()
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"--systems: accepted {','.join(SYSTEMS)}")
    if not VLLM_PYTHON.exists():
        print(f"no vLLM at {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)")
        return 1
    folder = args.model.expanduser()
    root = Path(tempfile.mkdtemp(prefix="vllm-engine-", dir=os.environ.get("OMNIFLOW_RUN_DIR")))
    up: list[tuple[Procs, object]] = []
    addrs: dict[str, str] = {}
    try:
        for name in dict.fromkeys(
            "topology" if s in ("direct", "gateway") else s for s in args.systems
        ):
            env = dict(kv.split("=", 1) for kv in args.worker_env)
            procs, addr, redis = start(name, root, folder, args.threads, env)
            up.append((procs, redis))
            for s in ("direct", "gateway") if name == "topology" else (name,):
                if s in args.systems:
                    addrs[s] = addr
        print(f"load {load_avg()}; {args.requests} requests of {args.prompt_tokens} prompt / "
              f"{args.max_tokens} output tokens each; {args.threads} threads")  # fmt: skip
        out = asyncio.run(run(args, {s: addrs[s] for s in args.systems}))
    finally:
        for procs, redis in reversed(up):
            procs.stop()
            if redis is not None:
                redis.stop()  # type: ignore[attr-defined]
    print("\n| concurrency | system | TTFT p50 ms | ITL p50 (mean) ms | last token p50 ms "
          "| output tok/s | / vLLM |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for conc, rows in out.items():
        ref = rows.get("vllm", {}).get("tok_s")
        for name, r in rows.items():
            ratio = f"{r['tok_s'] / ref:.2f}x" if ref else "-"
            print(f"| {conc} | {name} | {r['ttft_ms']:.1f} | {r['itl_ms']:.2f} "
                  f"({r['itl_mean_ms']:.2f}) | {r['e2e_ms']:.0f} | {r['tok_s']:.1f} "
                  f"| {ratio} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
