"""Benchmark of the KV index core on a private redis-server.

MatchPrefix p50/p99 on a 2,048-block chain held by 8 owners, against one Redis PING round
trip through the same client; event ingest (block events/s) against a pipelined SET loop
through the same client. Run: ``python bench/kv_index.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind, Tier
from omniflow.kv.index_store import KVIndex, OwnerInfo
from omniflow.localredis import start_redis


def redis_benchmark_set(port: int, n: int, pipeline: int) -> float | None:
    """SET requests/s by redis-benchmark (C client), or None when it is not installed."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    cmd = [exe, "-p", str(port), "-t", "set", "-n", str(n), "-P", str(pipeline), "-q"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    found = re.search(r"SET: ([\d.]+) requests per second", out)
    return float(found.group(1)) if found else None


def pct(samples: list[float], q: float) -> float:
    return sorted(samples)[min(len(samples) - 1, int(q * len(samples)))]


async def run(blocks: int, owners: int, iters: int, events: int, batch: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, start_redis(dir=Path(tmp)) as server:
        client = aioredis.Redis.from_url(server.url)
        idx = KVIndex(client)
        await idx.start()
        ns = await idx.register_namespace(KVLayout("bench/model", 16, 8, 64, "bfloat16", 16))
        chain = block_hashes(ns, list(range(16 * blocks)), 16)
        for i in range(owners):
            lease = await idx.register_owner(OwnerInfo(f"owner-{i}", "node", "addr"))
            # Owner i holds the whole chain, with a mix of tiers.
            entries = [BlockEntry(ns, h, Tier((i + j) % 3)) for j, h in enumerate(chain)]
            await idx.snapshot(lease.owner_id, lease.epoch, entries)
        match, ping = [], []
        for _ in range(iters):
            t = time.perf_counter()
            res = await idx.match_prefix(ns, chain)
            match.append(time.perf_counter() - t)
            t = time.perf_counter()
            await client.ping()
            ping.append(time.perf_counter() - t)
        assert res.longest_prefix == blocks and len(res.owners) == owners

        hashes = block_hashes(ns, list(range(16 * events)), 16)
        lease = await idx.register_owner(OwnerInfo("ingest", "node", "addr"))
        epoch = (await idx.snapshot("ingest", lease.epoch, [])).epoch
        batches = [
            [BlockEvent(EventKind.STORED, ns, h, Tier.HOST) for h in hashes[i : i + batch]]
            for i in range(0, len(hashes), batch)
        ]
        t = time.perf_counter()
        for seq, evs in enumerate(batches, 1):
            assert (await idx.apply_events("ingest", epoch, seq, evs)).ok
        ingest = events / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(0, events, batch):
            pipe = client.pipeline(transaction=False)
            for j in range(i, min(events, i + batch)):
                pipe.set(hashes[j], b"1")
            await pipe.execute()
        set_rate = events / (time.perf_counter() - t)
        await client.aclose()
        # The literal `redis-benchmark -t set` (50 clients, no pipelining), and pipelined.
        bench_plain = redis_benchmark_set(server.port, events, 1)
        bench_piped = redis_benchmark_set(server.port, events, batch)

    rows = [
        ("MatchPrefix p50 (ms)", statistics.median(match) * 1e3, statistics.median(ping) * 1e3),
        ("MatchPrefix p99 (ms)", pct(match, 0.99) * 1e3, pct(ping, 0.99) * 1e3),
        ("event ingest (events/s)", ingest, set_rate),
    ]
    print(
        f"kv index: {blocks}-block chain, {owners} owners, {iters} matches; "
        f"{events} events in batches of {batch}"
    )
    print(f"{'metric':<26}{'omniflow':>14}{'reference':>14}{'ratio':>9}   reference")
    refs = ["PING", "PING", "pipelined SET, same client"]
    for rate, ref in ((bench_plain, "redis-benchmark -t set"), (bench_piped, f"... -P {batch}")):
        if rate:
            rows.append(("event ingest (events/s)", ingest, rate))
            refs.append(ref)
    for (name, ours, ref), refname in zip(rows, refs, strict=True):
        print(f"{name:<26}{ours:>14.3f}{ref:>14.3f}{ours / ref:>9.2f}   {refname}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--owners", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1000)
    a = ap.parse_args()
    asyncio.run(run(a.blocks, a.owners, a.iters, a.events, a.batch))


if __name__ == "__main__":
    main()
