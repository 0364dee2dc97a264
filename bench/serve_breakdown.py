"""Where the time of one streamed chat goes, from the HTTP request to the first streamed byte
and to the last, at concurrency 1 and 16 (issue 19): the aiperf workload's shape (a
``--prompt-tokens`` chat prompt, exactly ``--max-tokens`` out with ``ignore_eos``, greedy).

    python bench/serve_breakdown.py                      # 1 and 16, 24 samples at 1
    python bench/serve_breakdown.py --samples 8 --rounds 1 --max-tokens 16   # smoke

Three kinds of timer, each step measured where it runs:

* in this process, the gateway's own CPU work on the same request: the body parsed into
  its pydantic model, the chat template rendered and tokenized with the prompt's block
  hashes (``omniflow.chat.Preprocessor``, as the gateway does it once), one SSE chunk built
  and encoded (``ChatCompletionChunk`` + ``sse``, as ``openai_api`` writes every token);
* on a real topology (``serve_stack.start_omniflow``: Redis, kv-index, kv-agent, router
  with ``llm=kv_aware``, one llm worker, the gateway): the pick as the gateway makes it in
  its own process (``omniflow.routing.picker``, kv_aware and round_robin, over the same
  discovery listing and way to the index), the router's ``Pick`` (the coordinator's path),
  the kv-index's ``MatchPrefix`` alone and the same match straight on Redis (one Lua
  call), and the same request through the gateway (raw HTTP/1.1 on a kept-alive
  connection) and as token ids to the worker's ``Generate`` directly, paired and
  interleaved (a different prompt each call: no prefix-cache hit between the pair); their
  median difference is what the gateway adds, its pick included;
* the engine in this process (the worker's engine class, same settings), its scheduler and
  forward timed per step: how long a new request waits before the step that admits it
  (scheduler wait), its prefill steps, the hand-off from the step's end to the stream that
  yields its first text, and the decode step of the running batch.

The topology's worker runs with ``--threads`` torch threads while this process's engine
runs alone (the topology idle): the two do not compete. Medians of every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serve_stack import MODEL, Procs, load_avg, start_omniflow

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.chat import Preprocessor
from omniflow.config import load_settings
from omniflow.discovery import make_registry
from omniflow.kv.index_store import KVIndex
from omniflow.localredis import redis_client
from omniflow.routing.picker import Picker
from omniflow.routing.settings import PickSettings
from omniflow.rpc.client import open_channel
from omniflow.workers import WORKER_SERVICE, worker_from_instance

FILLER = (
    "Explain in plain words how a hash table stores keys, why collisions happen, what a "
    "load factor is, and how resizing keeps lookups fast on average for large inputs. "
)
FIRST_TEXT = re.compile(rb'"content":"[^"]')


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def messages_for(pre: Preprocessor, i: int, tokens: int) -> list[dict[str, str]]:
    """A chat whose templated prompt is about ``tokens`` long, unique from its first page."""
    words = FILLER.split()
    n = len(words)
    while True:
        text = f"Request {i}. " + " ".join(words[k % len(words)] for k in range(n))
        msgs = [{"role": "user", "content": text}]
        if len(pre.encode_chat(msgs)) >= tokens:
            return msgs
        n += 8


# ------------------------------------------------------------- gateway CPU work, here


def gateway_cpu(pre: Preprocessor, body: bytes, samples: int) -> dict[str, float]:
    from omniflow_services.gateway.protocol import (
        ChatCompletionChunk,
        ChatCompletionRequest,
        ChunkChoice,
        Delta,
    )
    from omniflow_services.gateway.replies import sse

    parse, prep, render, encode, hashes, chunk = [], [], [], [], [], []
    for _ in range(samples):
        t = time.perf_counter()
        req = ChatCompletionRequest.model_validate_json(body)
        parse.append(time.perf_counter() - t)
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        t = time.perf_counter()
        ids = pre.encode_chat(msgs, add_generation_prompt=True)
        pre.block_hashes(ids)
        prep.append(time.perf_counter() - t)
        t = time.perf_counter()  # the same three steps, one at a time
        text = pre.render_chat(msgs, True)
        t1 = time.perf_counter()
        ids = pre.encode_piece(text)
        t2 = time.perf_counter()
        pre.block_hashes(ids)
        hashes.append(time.perf_counter() - t2)
        render.append(t1 - t)
        encode.append(t2 - t1)
        t = time.perf_counter()
        sse(
            ChatCompletionChunk(
                id="chatcmpl-1", created=1, model=MODEL,
                choices=[ChunkChoice(index=0, delta=Delta(content=" word"))],
            )
        )  # fmt: skip
        chunk.append(time.perf_counter() - t)
    return {
        "parse": med(parse), "prepare": med(prep), "render": med(render),
        "encode": med(encode), "hashes": med(hashes), "sse": med(chunk),
    }  # fmt: skip


# ------------------------------------------------------------- the engine, in-process


def engine_steps(
    folder: Path, prompts: list[list[int]], conc: int, max_tokens: int, threads: int
) -> dict[str, float]:
    """The engine alone: ``conc`` requests at once (after a warm-up), every step timed."""
    import torch

    from omniflow.sampling import SamplingParams
    from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest

    torch.set_num_threads(threads)
    engine = Engine(folder, EngineConfig(dtype="bfloat16", max_num_batched_tokens=512))
    steps: list[tuple[float, float, list[tuple[str, bool, bool]]]] = []
    run = engine._run

    def timed_run(scheduled, outputs):
        # Read before the forward: it advances num_computed and appends the sampled token.
        what = [(s.seq.request_id, s.completes, s.seq.num_output == 0) for s in scheduled]
        t0 = time.perf_counter()
        run(scheduled, outputs)
        steps.append((t0, time.perf_counter(), what))

    engine._run = timed_run  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(rid: str, ids: list[int]) -> tuple[float, float, list[float]]:
        added = time.perf_counter()
        first, last, gaps = 0.0, 0.0, []
        async for out in engine.generate(GenerateRequest(rid, ids, params=params)):
            now = time.perf_counter()
            if out.new_token_ids:
                if first:
                    gaps.append(now - last)
                else:
                    first = now
                last = now
        return added, first, gaps

    async def level(tag: str, batch: list[list[int]]):
        return await asyncio.gather(*(one(f"{tag}-{k}", ids) for k, ids in enumerate(batch)))

    asyncio.run(level("warm", prompts[-2:]))
    steps.clear()
    results = asyncio.run(level("r", prompts[:conc]))
    wait, prefill, handoff, ttft, itl = [], [], [], [], []
    for k, (added, first, gaps) in enumerate(results):
        rid = f"r-{k}"
        mine = [(t0, t1, c) for t0, t1, w in steps for r, c, p in w if r == rid and p]
        if not mine:
            continue
        wait.append(mine[0][0] - added)
        done = next(t1 for t0, t1, c in mine if c)
        prefill.append(done - mine[0][0])
        handoff.append(first - done)
        ttft.append(first - added)
        itl += gaps
    decode = [t1 - t0 for t0, t1, w in steps if all(not p for _, _, p in w)]
    return {
        "wait": med(wait),
        "prefill": med(prefill),
        "handoff": med(handoff),
        "ttft": med(ttft),
        "decode_step": med(decode),
        "itl": med(itl),
    }


# ------------------------------------------------------------- the topology


class Client:
    """One request through the gateway (raw HTTP) or straight to the worker's Generate."""

    def __init__(self, url: str, worker: str, pre: Preprocessor, max_tokens: int) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.pre = pre
        self.max_tokens = max_tokens
        self.channel = open_channel(worker, default_timeout_s=600, max_in_flight=None)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def gateway(self, msgs: list[dict[str, str]]) -> tuple[float, float]:
        body = json.dumps({
            "model": MODEL, "messages": msgs, "max_tokens": self.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
        }).encode()  # fmt: skip
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        for attempt in range(2):
            fresh = not self.conns
            if fresh:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            else:  # kept alive since its last request; the server may have closed it since
                reader, writer = self.conns.pop()
            start = time.perf_counter()
            writer.write(head + body)
            first, seen = 0.0, b""
            while not seen.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk
                data = await reader.read(65536)
                if not data:
                    break
                seen += data
                if not first and FIRST_TEXT.search(seen):
                    first = time.perf_counter() - start
            if seen.endswith(b"0\r\n\r\n"):
                break
            writer.close()
            if seen or fresh or attempt:
                raise RuntimeError(f"the gateway closed the connection: {seen[-300:]!r}")
        last = time.perf_counter() - start
        if b" 200 OK" not in seen[:64]:
            raise RuntimeError(f"the gateway answered {seen[:300]!r}")
        self.conns.append((reader, writer))
        return first, last

    async def direct(self, msgs: list[dict[str, str]]) -> tuple[float, float]:
        ids = self.pre.encode_chat(msgs)
        sampling = common_pb2.SamplingParams(
            max_tokens=self.max_tokens, temperature=0, ignore_eos=True
        )
        start = time.perf_counter()
        call = self.stub.Generate(
            worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling),
            timeout=600,
        )
        first = 0.0
        async for r in call:
            if r.token_ids and not first:
                first = time.perf_counter() - start
        return first, time.perf_counter() - start

    async def close(self) -> None:
        for _, w in self.conns:
            w.close()
        await self.channel.close()


async def topology_part(of, pre: Preprocessor, args: argparse.Namespace) -> dict[str, dict]:
    client = Client(of.url, of.worker, pre, args.max_tokens)
    serial = iter(range(10**6))

    def msgs() -> list[dict[str, str]]:
        return messages_for(pre, next(serial), args.prompt_tokens)

    for _ in range(2):  # warm: connections, the worker's first steps
        await client.gateway(msgs())
        await client.direct(msgs())
    out: dict[str, dict] = {}
    for conc in args.concurrency:
        gw_first, gw_last, dr_first, dr_last, add_first, add_last = [], [], [], [], [], []
        rounds = max(1, args.samples // conc) if conc == 1 else args.rounds
        for r in range(rounds):
            batch_g = [msgs() for _ in range(conc)]
            batch_d = [msgs() for _ in range(conc)]
            order = ("g", "d") if r % 2 else ("d", "g")
            got: dict[str, list[tuple[float, float]]] = {}
            for side in order:
                fn, batch = (client.gateway, batch_g) if side == "g" else (client.direct, batch_d)
                got[side] = list(await asyncio.gather(*(fn(m) for m in batch)))
            g, d = got["g"], got["d"]
            gw_first += [x[0] for x in g]
            gw_last += [x[1] for x in g]
            dr_first += [x[0] for x in d]
            dr_last += [x[1] for x in d]
            add_first.append(statistics.median(x[0] for x in g) - statistics.median(
                x[0] for x in d))  # fmt: skip
            add_last.append(statistics.median(x[1] for x in g) - statistics.median(
                x[1] for x in d))  # fmt: skip
        out[f"c{conc}"] = {
            "gw_ttft": med(gw_first), "gw_last": med(gw_last),
            "dr_ttft": med(dr_first), "dr_last": med(dr_last),
            "added_ttft": med(add_first), "added_last": med(add_last),
        }  # fmt: skip
        print(f"  concurrency {conc}: {out[f'c{conc}']}  (load {load_avg()})", flush=True)
    await client.close()
    out["rpc"] = await rpc_steps(of, args.run_dir, pre, msgs(), args.samples)
    return out


def index_address(run_dir: Path) -> str:
    """The kv-index's address, from the ready file its launcher wrote in the run folder."""
    return json.loads(next(run_dir.glob("kv-index.ready*")).read_text())["address"]


async def rpc_steps(
    of, procs_dir: Path, pre: Preprocessor, msgs: list[dict], samples: int
) -> dict[str, float]:
    """The gateway's in-process pick and the router's Pick (kv_aware, round_robin),
    MatchPrefix, and the same match on Redis, timed alone."""
    ids = pre.encode_chat(msgs)
    hashes = pre.block_hashes(ids)
    rch = open_channel(of.router, default_timeout_s=10, max_in_flight=None)
    router = router_pb2_grpc.RouterServiceStub(rch)
    index_addr = index_address(procs_dir)
    ich = open_channel(index_addr, default_timeout_s=10, max_in_flight=None)
    index = kvindex_pb2_grpc.KVIndexServiceStub(ich)
    redis = redis_client(of.base["OMNIFLOW_REDIS_URL"], 5.0)
    store = KVIndex(redis)
    await store.start()
    registry = make_registry("redis", url=of.base["OMNIFLOW_REDIS_URL"], timeout_s=5.0)
    picker = Picker(load_settings(PickSettings, env=of.base))

    async def resolve() -> str:
        return index_addr

    picker.open_index(resolve)
    picker.table.replace(worker_from_instance(i) for i in await registry.list(WORKER_SERVICE))
    namespace = bytes.fromhex(of.namespace)

    def local(strategy: str):
        async def one() -> None:
            r = await picker.pick("llm", strategy, namespace=namespace, hashes=hashes)
            picker.table.finish(r.worker.worker_id, picker.table.begin(r.worker.worker_id), True)

        return one

    async def timed(coro_fn) -> float:
        t = time.perf_counter()
        await coro_fn()
        return time.perf_counter() - t

    def pick(strategy: int):
        return lambda: router.Pick(
            router_pb2.PickRequest(
                role="llm", operation="generate", strategy=strategy,  # type: ignore[arg-type]
                kv_namespace=of.namespace, block_hashes=hashes, prompt_tokens=len(ids),
            ),
            timeout=5,
        )  # fmt: skip

    match = lambda: index.MatchPrefix(  # noqa: E731
        kvindex_pb2.MatchPrefixRequest(namespace=of.namespace, block_hashes=hashes), timeout=5
    )
    lua = lambda: store.match_prefix(bytes.fromhex(of.namespace), hashes)  # noqa: E731
    ping = lambda: redis.ping()  # noqa: E731
    calls = {
        "local_kv": local("kv_aware"),
        "local_rr": local("round_robin"),
        "pick_kv": pick(router_pb2.STRATEGY_KV_AWARE),
        "pick_rr": pick(router_pb2.STRATEGY_ROUND_ROBIN),
        "match_grpc": match,
        "match_redis": lua,
        "redis_ping": ping,
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(3):
        for fn in calls.values():
            await fn()
    for _ in range(max(samples, 20)):
        for k, fn in calls.items():
            times[k].append(await timed(fn))
    await rch.close()
    await ich.close()
    await redis.aclose()
    await picker.close()
    await registry.close()
    return {k: med(v) for k, v in times.items()}


# ------------------------------------------------------------- the table


def table(cpu: dict, top: dict, eng: dict, args: argparse.Namespace) -> str:
    levels = [f"c{c}" for c in args.concurrency]
    rpc = top.get("rpc", {})
    rows: list[tuple[str, ...]] = [("step", *[f"conc {c} p50 ms" for c in args.concurrency],
                                    "measured")]  # fmt: skip

    def row(name: str, values: list[float | None], how: str) -> None:
        cells = ["-" if v is None or v != v else f"{v:.2f}" for v in values]
        rows.append((name, *cells, how))

    same = len(levels)
    row("gateway: body parsed (pydantic)", [cpu["parse"]] * same, "in-process")
    row("gateway: template + tokenize + block hashes", [cpu["prepare"]] * same, "in-process")
    row("  chat template rendered (jinja)", [cpu["render"]] * same, "in-process")
    row("  tokenized (tokenizers)", [cpu["encode"]] * same, "in-process")
    row("  block hashes (xxh3_128 chain)", [cpu["hashes"]] * same, "in-process")
    row("gateway pick, kv_aware (in-process, one index match)", [rpc.get("local_kv")] * same,
        "in-process")  # fmt: skip
    row("  gateway pick, round_robin (in-process, no index)", [rpc.get("local_rr")] * same,
        "in-process")  # fmt: skip
    row("router Pick, kv_aware (the coordinator's; gRPC, index match inside)",
        [rpc.get("pick_kv")] * same, "client -> router")  # fmt: skip
    row("  router Pick, round_robin (no index)", [rpc.get("pick_rr")] * same, "client -> router")
    row("  kv-index MatchPrefix (gRPC)", [rpc.get("match_grpc")] * same, "client -> kv-index")
    row("  the same match on Redis (one Lua call)", [rpc.get("match_redis")] * same,
        "client -> Redis")  # fmt: skip
    row("  Redis PING", [rpc.get("redis_ping")] * same, "client -> Redis")
    row("engine: scheduler wait (added -> admitting step)", [eng[lv]["wait"] for lv in levels],
        "engine in-process")  # fmt: skip
    row("engine: prefill (admitting step -> its last chunk's end)",
        [eng[lv]["prefill"] for lv in levels], "engine in-process")  # fmt: skip
    row("engine: first text (step end -> stream yields it)", [eng[lv]["handoff"] for lv in levels],
        "engine in-process")  # fmt: skip
    row("engine: TTFT", [eng[lv]["ttft"] for lv in levels], "engine in-process")
    row("worker Generate TTFT (gRPC, direct)", [top[lv]["dr_ttft"] for lv in levels],
        "client -> worker")  # fmt: skip
    row("gateway TTFT (HTTP, streamed)", [top[lv]["gw_ttft"] for lv in levels],
        "client -> gateway")  # fmt: skip
    row("gateway added to TTFT (paired medians)", [top[lv]["added_ttft"] for lv in levels],
        "gateway - direct")  # fmt: skip
    row("gateway: one SSE chunk built + encoded", [cpu["sse"]] * same, "in-process")
    row("engine: decode step (batch of running requests)",
        [eng[lv]["decode_step"] for lv in levels], "engine in-process")  # fmt: skip
    row("engine: ITL", [eng[lv]["itl"] for lv in levels], "engine in-process")
    row("engine: last token", [eng[lv]["ttft"] + eng[lv]["itl"] * (args.max_tokens - 1)
                               for lv in levels], "engine in-process (TTFT + ITL x n)")  # fmt: skip
    row("worker Generate last token (gRPC, direct)", [top[lv]["dr_last"] for lv in levels],
        "client -> worker")  # fmt: skip
    row("gateway last byte (HTTP)", [top[lv]["gw_last"] for lv in levels], "client -> gateway")
    row("gateway added to the last byte (paired medians)",
        [top[lv]["added_last"] for lv in levels], "gateway - direct")  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--samples", type=int, default=24, help="requests at concurrency 1")
    ap.add_argument("--rounds", type=int, default=2, help="batches per level above 1")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--models-dir", type=Path, default=Path("~/.cache/omniflow/models"))
    args = ap.parse_args()

    from omniflow.models.resolve import resolve_model

    folder = resolve_model(MODEL, args.models_dir.expanduser())
    loads = [f"start {load_avg()}"]
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-breakdown-"))
    procs = Procs(tmp)
    args.run_dir = tmp
    redis = None
    try:
        of, redis = start_omniflow(procs, folder, args.threads)
        pre = Preprocessor.from_folder(folder, bytes.fromhex(of.namespace))
        body = json.dumps({
            "model": MODEL, "messages": messages_for(pre, 0, args.prompt_tokens),
            "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
        }).encode()  # fmt: skip
        cpu = gateway_cpu(pre, body, max(args.samples, 50))
        print(f"gateway CPU work: {cpu}", flush=True)
        top = asyncio.run(topology_part(of, pre, args))
        loads.append(f"after the topology {load_avg()}")
    finally:
        procs.stop()
        if redis is not None:
            redis.stop()  # type: ignore[attr-defined]
    # The engine alone, once the topology is gone (it would share the cores).
    prompts = [pre.encode_chat(messages_for(pre, 10**6 + k, args.prompt_tokens))
               for k in range(max(args.concurrency) + 2)]  # fmt: skip
    eng = {}
    for conc in args.concurrency:
        eng[f"c{conc}"] = engine_steps(folder, prompts, conc, args.max_tokens, args.threads)
        print(f"  engine concurrency {conc}: {eng[f'c{conc}']}", flush=True)
    loads.append(f"after the engine {load_avg()}")
    print()
    print(
        f"one streamed chat, {args.prompt_tokens} prompt tokens, {args.max_tokens} out "
        f"(ignore_eos), SmolLM2-135M bf16, {args.threads} torch threads, one llm worker"
    )
    print(table(cpu, top, eng, args))
    print(f"\nload average (1/5/15 min): {' | '.join(loads)}")
    print(f"logs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
