"""KV-aware routing: prefix-cache hit rate and time to first token of a multi-turn
workload with shared prefixes, routed ``kv_aware`` against ``round_robin`` and
``consistent_hash``.

Three llm echo TEST workers (real processes) with a prefix cache over block hashes of
the prompt bytes (16 per page, the project's hash contract), a fake prefill of
``--prefill-us`` per uncached byte, and their blocks published to the KV index in Redis;
the router reads the index directly (``OMNIFLOW_ROUTER_KV_INDEX=redis``). Caches are
bounded (LRU, ``--cache-blocks``): spreading a session over every worker costs room. Each session
is a conversation: turn ``t`` sends the whole history (a shared system prompt, the
session's opening, every earlier turn and reply). Sessions run concurrently; each
strategy gets fresh text (a salted system prompt), so no strategy profits from
another's cache. Per request: Pick → Generate on the picked worker → ReportOutcome;
TTFT is measured from before the Pick to the first streamed chunk.
Target: kv_aware's hit rate >= 2x round_robin's.

    python bench/control_kv_routing.py [--sessions 24 --turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from control_common import Procs

from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.convert import strategy_value
from omniflow.kv.blocks import block_hashes
from omniflow.rpc.client import open_channel
from omniflow.testing.echo_worker import ECHO_LAYOUT

STRATEGIES = ("round_robin", "consistent_hash", "kv_aware")


def text(rng: random.Random, n: int) -> str:
    words = ["cache", "page", "token", "image", "voice", "layer", "head", "block", "route"]
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(words))
    return " ".join(out)


async def one_strategy(
    router: str, strategy: str, sessions: int, turns: int, concurrency: int, seed: int
) -> tuple[float, float, dict[str, int]]:
    rng = random.Random(seed)
    system = f"[{strategy}] " + text(rng, 256)
    openings = [text(rng, 512) for _ in range(sessions)]
    asks = [[text(rng, 384) for _ in range(turns)] for _ in range(sessions)]
    channels: dict[str, object] = {}
    hit = prompt = 0
    ttfts: list[float] = []
    per_worker: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with open_channel(router, max_in_flight=None) as rch:
        rstub = router_pb2_grpc.RouterServiceStub(rch)

        async def session(i: int) -> None:
            nonlocal hit, prompt
            history = f"{system}\n{openings[i]}"
            async with sem:
                for t in range(turns):
                    history += f"\nuser: {asks[i][t]}\nassistant:"
                    hashes = block_hashes(
                        ECHO_LAYOUT.namespace, list(history.encode()), ECHO_LAYOUT.page_size
                    )
                    t0 = time.perf_counter()
                    pick = await rstub.Pick(
                        router_pb2.PickRequest(
                            role="llm",
                            strategy=strategy_value(strategy),  # type: ignore[arg-type]
                            session_key=f"session-{i}",
                            kv_namespace=ECHO_LAYOUT.namespace_hex,
                            block_hashes=hashes,
                        )
                    )
                    w = pick.worker
                    if w.address not in channels:
                        channels[w.address] = open_channel(w.address, max_in_flight=None)
                    stub = worker_pb2_grpc.WorkerServiceStub(channels[w.address])
                    first = None
                    reply = []
                    async for chunk in stub.Generate(
                        worker_pb2.GenerateRequest(text=history, sampling={"max_tokens": 24})
                    ):
                        if first is None:
                            first = time.perf_counter()
                        reply.append(chunk.text)
                        if chunk.usage.prompt_tokens:
                            hit += chunk.usage.cached_tokens
                            prompt += chunk.usage.prompt_tokens
                    assert first is not None
                    ttfts.append((first - t0) * 1e3)
                    per_worker[w.worker_id] = per_worker.get(w.worker_id, 0) + 1
                    await rstub.ReportOutcome(
                        router_pb2.ReportOutcomeRequest(worker_id=w.worker_id, success=True)
                    )
                    history += " " + "".join(reply)

        await asyncio.gather(*(session(i) for i in range(sessions)))
        stats = await rstub.GetStats(router_pb2.GetStatsRequest())
    for ch in channels.values():
        await ch.close()  # type: ignore[attr-defined]
    fallbacks = sum(v for k, v in stats.counters.items() if k.startswith("kv_fallback"))
    per_worker["(kv fallbacks so far)"] = fallbacks
    return hit / prompt, statistics.mean(ttfts), per_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefill-us", type=float, default=20.0)
    parser.add_argument(
        "--cache-blocks",
        type=int,
        default=2000,
        help="prefix cache per worker, in blocks: room for a third of the sessions each",
    )
    args = parser.parse_args()
    procs = Procs()
    try:
        env = {
            "OMNIFLOW_ECHO_PUBLISH_KV": "1",
            "OMNIFLOW_ECHO_PREFILL_US": str(args.prefill_us),
            "OMNIFLOW_ECHO_TOKEN_DELAY_MS": "1",
            "OMNIFLOW_ECHO_CACHE_BLOCKS": str(args.cache_blocks),
        }
        for i in range(3):
            procs.worker(f"llm-{i}", "llm", **env)
        router = procs.start(
            "omniflow_services.router",
            "router",
            OMNIFLOW_ROUTER_KV_INDEX="redis",
            OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S="0.05",
        )
        results = {
            s: asyncio.run(
                one_strategy(router, s, args.sessions, args.turns, args.concurrency, seed=i)
            )
            for i, s in enumerate(STRATEGIES)
        }
    finally:
        procs.close()
    base_hit, base_ttft = results["round_robin"][0], results["round_robin"][1]
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} at once, "
        f"3 llm workers, prefill {args.prefill_us} us per uncached byte, "
        f"cache {args.cache_blocks} blocks per worker\n"
    )
    rows = [("strategy", "hit rate", "vs round_robin", "mean TTFT ms", "vs round_robin", "picks")]
    for s, (hit, ttft, per) in results.items():
        picks = ", ".join(f"{k}={v}" for k, v in sorted(per.items()))
        rows.append(
            (
                s,
                f"{hit:.1%}",
                f"{hit / base_hit:.2f}x",
                f"{ttft:.1f}",
                f"{ttft / base_ttft:.2f}x",
                picks,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    ratio = results["kv_aware"][0] / base_hit
    print(
        f"\nkv_aware hit rate {ratio:.2f}x round_robin's (target >= 2x): "
        f"{'MET' if ratio >= 2 else 'NOT MET'}"
    )


if __name__ == "__main__":
    main()
