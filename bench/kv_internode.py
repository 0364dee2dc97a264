"""Inter-node page transfer: two kv-agent processes on loopback move 256 MiB of pages.

Real services: a private Redis, a kv-index and two kv-agents (processes). Agent B holds the
pages (written through the zero-copy commit path); agent A pulls them (``PullPages``) into
its host tier over the gRPC channel (``GetPages`` stream) and over NIXL (UCX READ of B's
pinned slots), checksums verified on arrival. Between runs A drops the pages again.
Reference, in the same run: one process ``sendall``s the same number of bytes to another
over a loopback TCP socket, which ``recv_into``s preallocated memory and acks.
Run: ``python bench/kv_internode.py [--mib 256] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.client import KVClient
from omniflow.localredis import start_redis
from omniflow.rpc.client import open_channel, wait_serving
from omniflow_services.kv_agent.nixl_channel import nixl_unavailable_reason


def _spawn(
    module: str, name: str, workdir: Path, env: dict[str, str]
) -> tuple[subprocess.Popen, dict]:
    ready = workdir / f"{name}.json"
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", f"omniflow_services.{module}"],
        env={**os.environ, **env, "OMNIFLOW_READY_FILE": str(ready), "OMNIFLOW_INSTANCE_ID": name},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    end = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"{name} did not start:\n{(workdir / f'{name}.log').read_text()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def _tcp_receiver(port_q: mp.Queue, total: int, reps: int) -> None:
    buf = np.empty(total, np.uint8)
    buf[:] = 1
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            for _ in range(reps):
                got = 0
                while got < total:
                    n = conn.recv_into(view[got:], min(total - got, 16 << 20))
                    if not n:
                        return
                    got += n
                conn.sendall(b"k")


def raw_tcp(total: int, reps: int) -> list[float]:
    """Seconds per ``sendall`` of ``total`` bytes to another process, until its ack."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_tcp_receiver, args=(q, total, reps))
    proc.start()
    data = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    times = []
    try:
        with socket.create_connection(("127.0.0.1", q.get(timeout=30))) as sock:
            for _ in range(reps):
                t = time.perf_counter()
                sock.sendall(memoryview(data))
                assert sock.recv(1) == b"k"
                times.append(time.perf_counter() - t)
    finally:
        proc.join(timeout=30)
    return times


async def pull_runs(a: str, b: str, layout: KVLayout, hashes: list[bytes], channel: str,
                    reps: int) -> list[float]:  # fmt: skip
    ns = layout.namespace.hex()
    times = []
    async with open_channel(a, default_timeout_s=120) as ch:
        agent = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        for _ in range(reps):
            t = time.perf_counter()
            reply = await agent.PullPages(
                kvagent_pb2.PullPagesRequest(
                    namespace=ns, block_hashes=hashes, source_address=b, channel=channel
                )
            )
            times.append(time.perf_counter() - t)
            assert reply.pulled == len(hashes) and reply.channel == channel, reply
            assert reply.checksum_failures == 0
            await agent.Evict(kvagent_pb2.EvictRequest(namespace=ns, block_hashes=hashes))
    return times


async def run(args: argparse.Namespace, workdir: Path) -> None:
    # Llama-3-8B-like KV: 32 layers x 8 KV heads x 128 dim, bf16, 16 tokens: 2 MiB pages.
    layout = KVLayout("bench/llama-8b", 32, 8, 128, "bfloat16", 16)
    if args.page_kib:
        layout = KVLayout("bench/custom", 1, 1, args.page_kib * 1024 // 64, "bfloat16", 16)
    n = args.mib * 2**20 // layout.page_bytes
    total = n * layout.page_bytes
    hashes = block_hashes(layout.namespace, list(range(16 * n)), 16)
    redis = start_redis(dir=workdir / "redis")
    procs: list[subprocess.Popen] = []
    tag = uuid.uuid4().hex[:6]
    try:
        env = {"OMNIFLOW_REDIS_URL": redis.url, "OMNIFLOW_METRICS_PORT": "-1",
               "OMNIFLOW_LOG_LEVEL": "WARNING"}  # fmt: skip
        p, index = _spawn("kv_index", f"bench-kvi-{tag}", workdir, env)
        procs.append(p)
        agent_env = {**env, "OMNIFLOW_KV_INDEX_ADDR": index["address"],
                     "OMNIFLOW_KV_HOST_BYTES": str(total + 16 * layout.page_bytes),
                     "OMNIFLOW_CALL_TIMEOUT_S": "120"}  # fmt: skip
        addr = {}
        for name in ("a", "b"):
            p, ready = _spawn("kv_agent", f"bench-{name}-{tag}", workdir,
                              {**agent_env, "OMNIFLOW_NODE_ID": f"node-{name}"})  # fmt: skip
            procs.append(p)
            addr[name] = ready["address"]
            await wait_serving(ready["address"], 10)
        rng = np.random.default_rng(1)
        async with KVClient(addr["b"], index["address"], timeout_s=120) as producer:
            await producer.register_namespace(layout)
            for i in range(0, n, 16):
                part = hashes[i : i + 16]
                blobs = [rng.integers(0, 256, layout.page_bytes, dtype=np.uint8) for _ in part]
                await producer.put(layout.namespace, part, blobs)
        results = {"grpc": await pull_runs(addr["a"], addr["b"], layout, hashes, "grpc", args.reps)}
        reason = nixl_unavailable_reason()
        async with open_channel(addr["a"]) as ch:
            transport = await kvagent_pb2_grpc.KVAgentServiceStub(ch).GetTransport(
                kvagent_pb2.GetTransportRequest()
            )
        if "nixl" in transport.channels:
            results["nixl"] = await pull_runs(
                addr["a"], addr["b"], layout, hashes, "nixl", args.reps
            )
        ref = await asyncio.to_thread(raw_tcp, total, args.reps)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        redis.stop()
    ref_gbs = total / statistics.median(ref) / 1e9
    print(
        f"inter-node pull, 2 agent processes on loopback: {n} pages of "
        f"{layout.page_bytes // 1024} KiB = {total / 2**20:.0f} MiB, median of {args.reps}"
    )
    print(f"{'channel':<30}{'GB/s':>8}{'raw TCP GB/s':>14}{'ratio':>8}")
    for channel, times in results.items():
        gbs = total / statistics.median(times) / 1e9
        print(f"{'PullPages ' + channel:<30}{gbs:>8.2f}{ref_gbs:>14.2f}{gbs / ref_gbs:>8.2f}")
    if "nixl" not in results:
        print(f"(NIXL channel not measured: {reason or 'the agents do not offer it'})")
    print(f"reference: sendall of {total / 2**20:.0f} MiB over loopback TCP to another process, "
          "recv_into preallocated memory, until its ack")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--page-kib", type=int, default=0, help="page size; 0: 2 MiB (Llama-8B)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="omniflow-bench-"))
    try:
        asyncio.run(run(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
