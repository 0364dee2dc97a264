"""KV-aware routing: prefix-cache hit rate, time to first token and load balance of
multi-turn workloads on 3 llm workers, routed by ``round_robin``, ``consistent_hash``
(session key), ``least_outstanding`` and ``kv_aware``.

The workers are echo TEST workers (real processes) whose compute model is a fake
continuous-batching engine (``omniflow_services.worker.echo.engine``): a step costs
``--step-ms`` plus ``--decode-us`` per request in decode plus ``--prefill-us`` per prompt
byte computed (at most ``--step-tokens`` bytes per step), so a busy worker serves
everyone slower; an LRU prefix cache spares the prefill of cached leading blocks and
publishes stored and evicted blocks to the KV index in Redis, which the router reads
(``OMNIFLOW_ROUTER_KV_INDEX=redis``). The caches together hold ``--cache-share`` times
the workload's distinct blocks (1.0: room for one copy of everything).

Workloads (``control_kv_workload``, seeded): ``chat`` — sessions over 3 system prompts,
each turn resending the whole history, Poisson arrivals, exponential think time;
``docs`` — groups of sessions (Zipf sizes) sharing a long document. Every strategy
serves the same requests from empty caches (``reset`` on each worker), in a rotated
order per repeat. Per request: Pick → Generate → ReportOutcome; TTFT from before the
Pick to the first streamed word. Hit rate = cached prompt bytes / prompt bytes.

    python bench/control_kv_routing.py [--scenarios chat docs --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import control_kv_workload as wl
from control_common import Procs, pct

from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.convert import strategy_value
from omniflow.kv.blocks import block_hashes
from omniflow.rpc.client import open_channel
from omniflow.values import to_python
from omniflow_services.worker.echo.engine import ECHO_LAYOUT

STRATEGIES = ("round_robin", "consistent_hash", "least_outstanding", "kv_aware")
WORKERS = 3


@dataclass(slots=True)
class RunResult:
    hit: float
    ttft_mean: float
    ttft_p90: float
    requests: dict[str, int]
    computed: dict[str, int]  # prefill bytes each worker computed
    busy: dict[str, float]  # modelled busy time per worker / wall time
    fallbacks: int


async def _counters(rstub: router_pb2_grpc.RouterServiceStub) -> dict[str, int]:
    stats = await rstub.GetStats(router_pb2.GetStatsRequest())
    return dict(stats.counters)


async def run_one(router: str, workers: list[str], strategy: str, load: wl.Workload) -> RunResult:
    wchannels = {a: open_channel(a, max_in_flight=None) for a in workers}
    for ch in wchannels.values():
        await worker_pb2_grpc.WorkerServiceStub(ch).Invoke(
            worker_pb2.InvokeRequest(operation="reset")
        )
    hit = prompt = 0
    ttfts: list[float] = []
    requests: dict[str, int] = {}
    async with open_channel(router, max_in_flight=None) as rch:
        rstub = router_pb2_grpc.RouterServiceStub(rch)
        before = await _counters(rstub)
        t_start = time.perf_counter()

        async def session(s: wl.Session) -> None:
            nonlocal hit, prompt
            await asyncio.sleep(s.start_s)
            for turn in s.turns:
                await asyncio.sleep(turn.think_s)
                data = turn.prompt.encode()
                hashes = block_hashes(ECHO_LAYOUT.namespace, list(data), ECHO_LAYOUT.page_size)
                t0 = time.perf_counter()
                pick = await rstub.Pick(
                    router_pb2.PickRequest(
                        role="llm",
                        strategy=strategy_value(strategy),  # type: ignore[arg-type]
                        session_key=s.key,
                        kv_namespace=ECHO_LAYOUT.namespace_hex,
                        block_hashes=hashes,
                    )
                )
                w = pick.worker
                stub = worker_pb2_grpc.WorkerServiceStub(wchannels[w.address])
                first = None
                async for chunk in stub.Generate(
                    worker_pb2.GenerateRequest(
                        text=turn.prompt, sampling={"max_tokens": turn.max_tokens}
                    )
                ):
                    if first is None:
                        first = time.perf_counter()
                    if chunk.usage.prompt_tokens:
                        hit += chunk.usage.cached_tokens
                        prompt += chunk.usage.prompt_tokens
                assert first is not None
                ttfts.append((first - t0) * 1e3)
                requests[w.worker_id] = requests.get(w.worker_id, 0) + 1
                await rstub.ReportOutcome(
                    router_pb2.ReportOutcomeRequest(worker_id=w.worker_id, success=True)
                )

        await asyncio.gather(*(session(s) for s in load.sessions))
        wall = time.perf_counter() - t_start
        after = await _counters(rstub)
    computed, busy = {}, {}
    for ch in wchannels.values():
        reply = await worker_pb2_grpc.WorkerServiceStub(ch).Invoke(
            worker_pb2.InvokeRequest(operation="stats")
        )
        st = {k: to_python(v) for k, v in reply.outputs.items()}
        computed[str(st["worker"])] = int(st["computed_tokens"])
        busy[str(st["worker"])] = float(st["busy_s"]) / wall
        await ch.close()
    fallbacks = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("kv_fallback"))
    return RunResult(
        hit / prompt,
        statistics.mean(ttfts),
        pct(ttfts, 0.9),
        requests,
        computed,
        busy,
        fallbacks,
    )


async def _wait_for_workers(router: str) -> None:
    async with open_channel(router, max_in_flight=None) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        for _ in range(200):
            found = await stub.ListWorkers(router_pb2.ListWorkersRequest(role="llm"))
            if len(found.workers) == WORKERS:
                return
            await asyncio.sleep(0.05)
    raise RuntimeError("the router did not see the workers")


def _imbalance(values: dict[str, float] | dict[str, int]) -> float:
    """max / mean over the workers (1.0: even; 3.0: one worker did everything)."""
    vals = [float(values.get(f"llm-{i}", 0)) for i in range(WORKERS)]
    mean = sum(vals) / len(vals)
    return max(vals) / mean if mean else 0.0


def report(name: str, loads: list[wl.Workload], runs: dict[str, list[RunResult]]) -> None:
    load = loads[0]
    base = statistics.mean(r.hit for r in runs["round_robin"])
    base_ttft = statistics.mean(r.ttft_mean for r in runs["round_robin"])
    print(
        f"\n## {name} (seed 0): {len(load.sessions)} sessions, {load.requests} requests, "
        f"{load.prompt_bytes() / load.requests:.0f} prompt bytes per request on average, "
        f"{load.distinct_blocks()} distinct blocks; {len(next(iter(runs.values())))} repeats"
    )
    # Every distinct block computed once, by one cache that never evicts.
    page = ECHO_LAYOUT.page_size
    bound = statistics.mean(1 - w.distinct_blocks() * page / w.prompt_bytes() for w in loads)
    print(
        f"hit rate bound (one unbounded cache, mean over seeds): {bound:.1%} = "
        f"{bound / statistics.mean(r.hit for r in runs['round_robin']):.2f}x round_robin's\n"
    )
    head = (
        "strategy",
        "hit rate",
        "(min-max)",
        "vs rr",
        "TTFT mean ms",
        "vs rr",
        "TTFT p90 ms",
        "req max/mean",
        "prefill max/mean",
        "busy (mean)",
        "kv fallbacks",
    )
    rows = [head]
    for s, rs in runs.items():
        hit = statistics.mean(r.hit for r in rs)
        ttft = statistics.mean(r.ttft_mean for r in rs)
        busy = statistics.mean(sum(r.busy.values()) / WORKERS for r in rs)
        rows.append(
            (
                s,
                f"{hit:.1%}",
                f"{min(r.hit for r in rs):.1%}-{max(r.hit for r in rs):.1%}",
                f"{hit / base:.2f}x",
                f"{ttft:.0f}",
                f"{ttft / base_ttft:.2f}x",
                f"{statistics.mean(r.ttft_p90 for r in rs):.0f}",
                f"{statistics.mean(_imbalance(r.requests) for r in rs):.2f}",
                f"{statistics.mean(_imbalance(r.computed) for r in rs):.2f}",
                f"{busy:.0%}",
                str(sum(r.fallbacks for r in rs)),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    ratio = statistics.mean(r.hit for r in runs["kv_aware"]) / base
    print(
        f"\nkv_aware hit rate {ratio:.2f}x round_robin's (target >= 2x): "
        f"{'MET' if ratio >= 2 else 'NOT MET'}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", nargs="+", default=["chat", "docs"], choices=["chat", "docs"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sessions", type=int, default=0, help="0: 48 for chat, 36 for docs")
    p.add_argument("--rate", type=float, default=0, help="session arrivals per second")
    p.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns")
    p.add_argument("--prefill-us", type=float, default=20.0, help="per uncached prompt byte")
    p.add_argument("--step-ms", type=float, default=8.0, help="fixed time of one engine step")
    p.add_argument("--decode-us", type=float, default=200.0, help="per request in decode")
    p.add_argument("--step-tokens", type=int, default=2048, help="prefill bytes per step")
    p.add_argument("--cache-share", type=float, default=1.0)
    p.add_argument("--router-env", nargs="*", default=[], help="extra KEY=VALUE for the router")
    args = p.parse_args()
    loads = {}
    for name in args.scenarios:
        gen = wl.chat if name == "chat" else wl.docs
        sessions = args.sessions or (48 if name == "chat" else 36)
        rate = args.rate or (4.0 if name == "chat" else 3.0)
        loads[name] = [gen(seed, sessions, rate, args.think_s) for seed in range(args.repeats)]
    results: dict[str, dict[str, list[RunResult]]] = {}
    for name, seeds in loads.items():
        cache = int(args.cache_share * seeds[0].distinct_blocks() / WORKERS)
        env = {
            "OMNIFLOW_ECHO_PUBLISH_KV": "1",
            "OMNIFLOW_ECHO_PREFILL_US": str(args.prefill_us),
            "OMNIFLOW_ECHO_TOKEN_DELAY_MS": str(args.step_ms),
            "OMNIFLOW_ECHO_DECODE_US": str(args.decode_us),
            "OMNIFLOW_ECHO_STEP_TOKENS": str(args.step_tokens),
            "OMNIFLOW_ECHO_CACHE_BLOCKS": str(cache),
        }
        procs = Procs()  # per scenario: its own Redis, router and workers
        try:
            router = procs.start(
                "omniflow_services.router",
                "router",
                OMNIFLOW_ROUTER_KV_INDEX="redis",
                **dict(kv.split("=", 1) for kv in args.router_env),
            )
            workers = [procs.worker(f"llm-{i}", "llm", **env) for i in range(WORKERS)]
            asyncio.run(_wait_for_workers(router))
            runs: dict[str, list[RunResult]] = {s: [] for s in args.strategies}
            for rep, load in enumerate(seeds):
                k = rep % len(args.strategies)
                for s in args.strategies[k:] + args.strategies[:k]:
                    r = asyncio.run(run_one(router, workers, s, load))
                    runs[s].append(r)
                    print(
                        f"  {name} seed {rep} {s}: hit {r.hit:.1%} "
                        f"ttft {r.ttft_mean:.0f}/{r.ttft_p90:.0f} ms req {r.requests}",
                        flush=True,
                    )
        finally:
            procs.close()
        results[name] = runs
        print(f"  ({name}: cache per worker {cache} blocks)")
    print(
        f"\n3 echo llm workers; step {args.step_ms} ms + {args.decode_us} us per request in "
        f"decode + {args.prefill_us} us per prompt byte computed (<= {args.step_tokens} per "
        f"step); caches together hold {args.cache_share}x each workload's distinct blocks"
    )
    for name, runs in results.items():
        report(name, loads[name], runs)


if __name__ == "__main__":
    main()
