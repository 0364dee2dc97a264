"""Benchmark of the KV index core on one Redis and on a Redis Cluster, and of the router's Pick.

For each backend (a private redis-server; three local cluster-enabled redis-servers), each
index size (blocks held in total) and each owner count: every owner holds its own chain of
size/owners blocks (mixed tiers); MatchPrefix p50/p99 of a random owner's chain (up to
``--match-blocks`` long) beside one PING through the same client; block events/s ingested
in batches beside a pipelined SET loop through the same client; memory per block (Redis's
used_memory before and after the owners' snapshots, summed over the cluster's masters).
Then the router's kv_aware Pick (its core, ``WorkerTable.pick``) with 256 and 1,024
registered workers and the index's answer for 16 of them.

    python bench/kv_index.py                                   # the issue's table (long)
    python bench/kv_index.py --sizes 2000 --owners 4 --iters 20 --events 2000   # smoke

The sizes are what Redis holds here: 10^7 blocks need several GB of memory.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind, Tier
from omniflow.kv.index_store import KVIndex, OwnerInfo, OwnerMatch
from omniflow.localredis import redis_client, start_redis
from omniflow.routing.table import WorkerTable
from omniflow.testing.redis_cluster import local_cluster, missing_reason
from omniflow.workers import WorkerRecord

LOAD_LEASE_MS = 3_600_000
LAYOUT = KVLayout("bench/model", 16, 8, 64, "bfloat16", 16)


def pct(samples: list[float], q: float) -> float:
    return sorted(samples)[min(len(samples) - 1, int(q * len(samples)))]


@asynccontextmanager
async def backend(kind: str, tmp: Path) -> AsyncIterator[tuple[Any, Callable[[], int]]]:
    """A client of ``kind`` (single or cluster) and a function giving used memory."""
    if kind == "single":
        with start_redis(dir=tmp / "single") as server:
            client = aioredis.Redis.from_url(server.url)
            import redis as sync_redis

            sync = sync_redis.Redis(port=server.port, password=server.password or None)
            try:
                yield client, lambda: int(sync.info("memory")["used_memory"])
            finally:
                await client.aclose()
    else:
        with local_cluster(tmp / "cluster") as cluster:
            client = redis_client(cluster.url, 10.0, decode_responses=False)
            try:
                yield client, cluster.used_memory
            finally:
                await client.aclose()


async def settled(memory: Callable[[], int]) -> int:
    """Used memory once the previous case's FLUSHALL ASYNC has freed it (stops falling)."""
    last = memory()
    for _ in range(600):
        await asyncio.sleep(0.5)
        now = memory()
        if now >= last * 0.99:
            return now
        last = now
    return last


async def one_case(
    client: Any, memory: Callable[[], int], size: int, owners: int, a: argparse.Namespace
) -> dict[str, float]:
    idx = KVIndex(client, prefix=f"b{uuid.uuid4().hex[:6]}:")
    await idx.start()
    ns = await idx.register_namespace(LAYOUT)
    per = max(1, size // owners)
    before = await settled(memory)
    chains: list[list[bytes]] = []
    for i in range(owners):
        chain = block_hashes(ns, [i * 1_000_003 + t for t in range(16 * per)], 16)
        # A lease that outlives the loading (10^7 blocks take minutes): the owners stay live.
        info = OwnerInfo(f"owner-{i}", f"node-{i % 8}", f"a{i}:1")
        lease = await idx.register_owner(info, lease_ms=LOAD_LEASE_MS)
        step = idx.max_events  # a snapshot, then batches of events: each script stays short
        for start in range(0, per, step):
            entries = [BlockEntry(ns, h, Tier((i + j) % 3)) for j, h in
                       enumerate(chain[start : start + step], start)]  # fmt: skip
            if start == 0:
                await idx.snapshot(lease.owner_id, lease.epoch, entries)
            else:
                seq = start // step
                evs = [BlockEvent(EventKind.STORED, e.namespace, e.block_hash, e.tier)
                       for e in entries]  # fmt: skip
                assert (await idx.apply_events(lease.owner_id, lease.epoch, seq, evs)).ok
        chains.append(chain[: a.match_blocks])
    mem_per_block = (memory() - before) / (per * owners)
    rng = random.Random(1)
    match, ping = [], []
    for _ in range(a.iters):
        chain = chains[rng.randrange(owners)]
        t = time.perf_counter()
        res = await idx.match_prefix(ns, chain)
        match.append(time.perf_counter() - t)
        t = time.perf_counter()
        await client.ping()
        ping.append(time.perf_counter() - t)
        assert res.longest_prefix == len(chain), (res.longest_prefix, len(chain))
    hashes = block_hashes(ns, list(range(10**9, 10**9 + 16 * a.events)), 16)
    lease = await idx.register_owner(OwnerInfo("ingest", "node", "addr"), lease_ms=LOAD_LEASE_MS)
    epoch = (await idx.snapshot("ingest", lease.epoch, [])).epoch
    t = time.perf_counter()
    for seq, i in enumerate(range(0, a.events, a.batch), 1):
        evs = [BlockEvent(EventKind.STORED, ns, h, Tier.HOST) for h in hashes[i : i + a.batch]]
        assert (await idx.apply_events("ingest", epoch, seq, evs)).ok
    ingest = a.events / (time.perf_counter() - t)
    t = time.perf_counter()
    tag = idx._shard(ns)  # the SETs land in the namespace's slot, as the scripts' writes do
    for i in range(0, a.events, a.batch):
        pipe = client.pipeline(transaction=False)
        for j in range(i, min(a.events, i + a.batch)):
            pipe.set(tag + b"x:" + hashes[j], b"1")
        await pipe.execute()
    set_rate = a.events / (time.perf_counter() - t)
    await client.flushall(asynchronous=True)  # the next case starts empty (10^7: gigabytes)
    return {
        "match_p50_ms": statistics.median(match) * 1e3,
        "match_p99_ms": pct(match, 0.99) * 1e3,
        "ping_p50_ms": statistics.median(ping) * 1e3,
        "events_s": ingest,
        "set_s": set_rate,
        "bytes_per_block": mem_per_block,
    }


def pick_latency(workers: int, iters: int) -> tuple[float, float]:
    """p50/p99 (ms) of a kv_aware Pick with ``workers`` registered, 16 of them reachable."""
    table = WorkerTable(seed=1)
    table.replace(
        WorkerRecord(f"w{i}", "llm", f"127.0.0.1:{10000 + i}", node=f"node{i % 64}",
                     operations=("generate",))
        for i in range(workers)
    )  # fmt: skip
    rng = random.Random(2)
    reach = [
        OwnerMatch(f"w{rng.randrange(workers)}", "", "", "worker", (m := rng.randrange(1, 128)),
                   (m, 0, 0))
        for _ in range(16)
    ]  # fmt: skip
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        table.pick("llm", "kv_aware", reach=reach, prompt_blocks=128)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3, pct(samples, 0.99) * 1e3


async def run(a: argparse.Namespace) -> None:
    print(f"kv index: chains up to {a.match_blocks} blocks, {a.iters} matches per case, "
          f"{a.events} events in batches of {a.batch}")  # fmt: skip
    head = (f"{'redis':<8}{'blocks':>10}{'owners':>8}{'match p50':>11}{'p99':>8}{'PING p50':>10}"
            f"{'events/s':>11}{'SET/s':>10}{'ratio':>7}{'B/block':>9}")  # fmt: skip
    print(head)
    for kind in a.redis.split(","):
        if kind == "cluster" and (reason := missing_reason()):
            print(f"{kind:<8}skipped: {reason}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            async with backend(kind, Path(tmp)) as (client, memory):
                for size in (int(s) for s in a.sizes.split(",")):
                    for owners in (int(o) for o in a.owners.split(",")):
                        r = await one_case(client, memory, size, owners, a)
                        ratio = r["events_s"] / r["set_s"]
                        print(f"{kind:<8}{size:>10}{owners:>8}{r['match_p50_ms']:>11.3f}"
                              f"{r['match_p99_ms']:>8.3f}{r['ping_p50_ms']:>10.3f}"
                              f"{r['events_s']:>11.0f}{r['set_s']:>10.0f}"
                              f"{ratio:>7.2f}{r['bytes_per_block']:>9.0f}")  # fmt: skip
    print(f"\n{'router Pick (kv_aware)':<26}{'p50 ms':>9}{'p99 ms':>9}")
    for n in (int(w) for w in a.pick_workers.split(",")):
        p50, p99 = pick_latency(n, a.pick_iters)
        print(f"{f'{n} workers':<26}{p50:>9.3f}{p99:>9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--redis", default="single,cluster", help="backends: single, cluster")
    ap.add_argument("--sizes", default="100000,1000000,10000000", help="blocks held in total")
    ap.add_argument("--owners", default="16,256,1024")
    ap.add_argument("--match-blocks", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--pick-workers", default="256,1024")
    ap.add_argument("--pick-iters", type=int, default=2000)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
