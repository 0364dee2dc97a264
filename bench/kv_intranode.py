"""Intra-node page hand-off through the agent's shared-memory host tier.

Worker A (a process) writes 256 MiB of pages into slots the agent reserved; worker B
(another process) asks the agent for them by block hash, gets pinned slots back, and
copies each page into its own preallocated buffer — one memcpy per page. The agent is the
main process; the request/reply to it goes over a pipe (standing in for the local gRPC
call). Reference, measured in B in the same run: one plain memcpy of 256 MiB into
preallocated memory. Run: ``python bench/kv_intranode.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import uuid
from multiprocessing.connection import Connection

import numpy as np

from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow_services.kv_agent.host_tier import HostArena, HostTier
from omniflow_services.kv_agent.tiers import TieredStore


def writer(name: str, conn: Connection) -> None:
    arena = HostArena.attach(name)
    rng = np.random.default_rng(0)
    page = rng.integers(0, 256, arena.page_bytes, dtype=np.uint8)
    slots: list[int] = conn.recv()
    for i, slot in enumerate(slots):
        page[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)  # pages differ
        arena.write(slot, page)
    conn.send("written")
    arena.close()


def reader(name: str, total: int, reps: int, conn: Connection) -> None:
    arena = HostArena.attach(name)
    dst = np.empty(total, dtype=np.uint8)
    dst[:] = 1  # fault the pages in: the destination is preallocated memory
    src = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    ours, ref = [], []
    for _ in range(reps):
        t = time.perf_counter()
        conn.send("get")
        slots: list[int] = conn.recv()
        pb = arena.page_bytes
        for i, slot in enumerate(slots):
            np.copyto(dst[i * pb : (i + 1) * pb], arena.view(slot))
        conn.send("release")
        ours.append(time.perf_counter() - t)
        conn.recv()
        t = time.perf_counter()
        np.copyto(dst, src)
        ref.append(time.perf_counter() - t)
    conn.send((ours, ref))
    arena.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    layout = KVLayout("bench/llama-1b", 16, 8, 64, "bfloat16", 16)  # 512 KiB pages
    pages = args.mib * 2**20 // layout.page_bytes
    total = pages * layout.page_bytes
    hashes = block_hashes(layout.namespace, list(range(16 * pages)), 16)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    arena = HostArena.create(name, layout.page_bytes, pages)
    ctx = mp.get_context("spawn")
    try:
        store = TieredStore(HostTier(arena))
        a_end, a = ctx.Pipe()
        pa = ctx.Process(target=writer, args=(name, a))
        pa.start()
        reservations = [store.reserve(layout.namespace, h) for h in hashes]
        a_end.send([r.slot for r in reservations if r is not None])
        assert a_end.recv() == "written"
        pa.join()
        for r in reservations:
            assert r is not None
            store.commit(r)

        b_end, b = ctx.Pipe()
        pb = ctx.Process(target=reader, args=(name, total, args.reps, b))
        pb.start()
        for _ in range(args.reps):
            assert b_end.recv() == "get"
            handles = [store.acquire(layout.namespace, h) for h in hashes]
            b_end.send([hd.slot for hd in handles if hd is not None])
            assert b_end.recv() == "release"
            for hd in handles:
                assert hd is not None
                store.release(hd)
            b_end.send("ok")
        ours, ref = b_end.recv()
        pb.join()
    finally:
        arena.close()
        arena.unlink()
    gbs = total / statistics.median(ours) / 1e9
    ref_gbs = total / statistics.median(ref) / 1e9
    print(
        f"intra-node get: {pages} pages of {layout.page_bytes // 1024} KiB = "
        f"{total / 2**20:.0f} MiB, median of {args.reps}"
    )
    print(f"{'metric':<34}{'omniflow':>10}{'reference':>11}{'ratio':>8}   reference")
    print(
        f"{'GB/s, worker B gets A pages':<34}{gbs:>10.2f}{ref_gbs:>11.2f}{gbs / ref_gbs:>8.2f}"
        "   memcpy 256 MiB to preallocated"
    )


if __name__ == "__main__":
    main()
