"""Intra-node page hand-off through a real kv-agent process (the gRPC edge, not the core).

Worker A (a process) stores 256 MiB of pages with the client library's zero-copy path
(reserve slots, write in place, commit). Worker B (this process) asks for them by block
hash (``KVClient.locate``: one LocatePages call), copies each pinned page out of the
mapped arena into its own preallocated buffer, and unpins. Reference, in the same run: one
plain memcpy of 256 MiB into preallocated memory. Complements ``kv_intranode.py``, which
measures the store core with a pipe in place of the RPC.
Run: ``python bench/kv_intranode_agent.py [--mib 256] [--reps 7]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.client import KVClient
from omniflow.localredis import start_redis


def _spawn(
    module: str, name: str, workdir: Path, env: dict[str, str]
) -> tuple[subprocess.Popen, dict]:
    """Start a service process; its ready file gives its address."""
    ready = workdir / f"{name}.json"
    with open(workdir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"omniflow_services.{module}"],
            env={**os.environ, **env, "OMNIFLOW_READY_FILE": str(ready),
                 "OMNIFLOW_INSTANCE_ID": name},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    end = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"{name} did not start:\n{(workdir / f'{name}.log').read_text()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


LAYOUT = KVLayout("bench/llama-1b", 16, 8, 64, "bfloat16", 16)  # 512 KiB pages


def _writer(agent: str, index: str, n: int) -> None:
    async def go() -> None:
        hashes = block_hashes(LAYOUT.namespace, list(range(16 * n)), 16)
        page = np.random.default_rng(0).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
        async with KVClient(agent, index, timeout_s=120) as kv:
            await kv.register_namespace(LAYOUT)
            for i in range(0, n, 64):
                blobs = []
                for j in range(i, min(i + 64, n)):
                    page[:8] = np.frombuffer(j.to_bytes(8, "little"), np.uint8)
                    blobs.append(page.copy())
                assert await kv.put(LAYOUT.namespace, hashes[i : i + 64], blobs) == len(blobs)

    asyncio.run(go())


async def run(args: argparse.Namespace, workdir: Path) -> None:
    n = args.mib * 2**20 // LAYOUT.page_bytes
    total = n * LAYOUT.page_bytes
    hashes = block_hashes(LAYOUT.namespace, list(range(16 * n)), 16)
    redis = start_redis(dir=workdir / "redis")
    procs = []
    try:
        env = {"OMNIFLOW_REDIS_URL": redis.url, "OMNIFLOW_METRICS_PORT": "-1",
               "OMNIFLOW_LOG_LEVEL": "WARNING"}  # fmt: skip
        p, index = _spawn("kv_index", "bench-intra-kvi", workdir, env)
        procs.append(p)
        p, agent = _spawn("kv_agent", "bench-intra-agent", workdir, {
            **env, "OMNIFLOW_KV_INDEX_ADDR": index["address"],
            "OMNIFLOW_KV_HOST_BYTES": str(total + 16 * LAYOUT.page_bytes)})  # fmt: skip
        procs.append(p)
        w = mp.get_context("spawn").Process(
            target=_writer, args=(agent["address"], index["address"], n)
        )
        w.start()
        w.join()
        assert w.exitcode == 0
        dst = np.empty(total, np.uint8)
        dst[:] = 1
        src = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
        ours, ref = [], []
        pb = LAYOUT.page_bytes
        async with KVClient(agent["address"], timeout_s=120) as kv:
            for _ in range(args.reps):
                t = time.perf_counter()
                async with await kv.locate(LAYOUT.namespace, hashes) as got:
                    assert len(got) == n
                    for i, view in enumerate(got.views):
                        np.copyto(dst[i * pb : (i + 1) * pb], view)
                    del view  # no view may outlive the pin
                ours.append(time.perf_counter() - t)
                t = time.perf_counter()
                np.copyto(dst, src)
                ref.append(time.perf_counter() - t)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=15)
        redis.stop()
    gbs = total / statistics.median(ours) / 1e9
    ref_gbs = total / statistics.median(ref) / 1e9
    print(f"intra-node get through a kv-agent process: {n} pages of {pb // 1024} KiB = "
          f"{total / 2**20:.0f} MiB, median of {args.reps}")  # fmt: skip
    print(f"{'metric':<38}{'omniflow':>10}{'reference':>11}{'ratio':>8}   reference")
    print(f"{'GB/s, worker B gets A pages (RPC)':<38}{gbs:>10.2f}{ref_gbs:>11.2f}"
          f"{gbs / ref_gbs:>8.2f}   memcpy 256 MiB to preallocated")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="omniflow-bench-"))
    try:
        asyncio.run(run(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
