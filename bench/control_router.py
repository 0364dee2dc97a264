"""Router: ``Pick`` latency against a bare unary RPC; proxy mode against direct calls;
and the same fake-worker set-up behind the ``sglang-router`` package as a peer.

- Pick: p50/p99 of ``RouterService/Pick`` (round_robin, and kv_aware with 32 block
  hashes answered by the KV index in Redis) against ``WorkerService/GetLoad`` called
  directly on a worker (a bare unary RPC through the same runtime).
- Proxy: ``Invoke(noop)`` and ``Generate`` (5 streamed chunks) through the router's
  WorkerService against the same calls made directly on the workers (client-side
  round robin over 2 workers); sequential latency and throughput at 32 in flight.
- Peer: a fake HTTP worker (aiohttp, ``POST /generate`` answering at once) called
  directly and through ``sglang_router.launch_router`` (round_robin); its added latency
  beside ours. Skipped with a note when ``sglang_router`` is not installed.

All real processes on 127.0.0.1.

    python bench/control_router.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from control_common import Procs, pct

from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.kv.blocks import block_hashes
from omniflow.rpc.client import open_channel
from omniflow_services.worker.echo.engine import ECHO_LAYOUT

FAKE_HTTP_WORKER = r"""
import sys
from aiohttp import web
async def generate(request):
    body = await request.json()
    return web.json_response({"text": "echo: " + str(body.get("text", "")),
                              "meta_info": {"finish_reason": {"type": "stop"}}})
async def ok(request):
    return web.json_response({"status": "ok", "model_path": "echo", "is_generation": True})
app = web.Application()
app.router.add_post("/generate", generate)
for path in ("/health", "/health_generate", "/get_server_info", "/get_model_info",
             "/v1/models", "/server_info", "/model_info"):
    app.router.add_get(path, ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


async def timed(fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def throughput(fn: Callable[[], Awaitable[object]], n: int, concurrency: int) -> float:
    left = n

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await fn()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


def row(rows: list[tuple[str, ...]], label: str, ours: list[float], ref: list[float]) -> None:
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        a, b = pct(ours, q), pct(ref, q)
        rows.append(
            (f"{label} {name} ms", f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x", f"{a - b:+.3f}")
        )


def show(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print()


async def ours(router: str, workers: list[str], calls: int) -> tuple[float, float]:
    hashes = block_hashes(ECHO_LAYOUT.namespace, list(b"x" * 16 * 32), ECHO_LAYOUT.page_size)
    async with contextlib.AsyncExitStack() as stack:
        rch = await stack.enter_async_context(open_channel(router, max_in_flight=None))
        wchs = [
            await stack.enter_async_context(open_channel(w, max_in_flight=None)) for w in workers
        ]
        rstub = router_pb2_grpc.RouterServiceStub(rch)
        proxy = worker_pb2_grpc.WorkerServiceStub(rch)
        direct = [worker_pb2_grpc.WorkerServiceStub(c) for c in wchs]
        turn = iter(range(10**9))

        def pick_rr() -> Awaitable[object]:
            return rstub.Pick(router_pb2.PickRequest(role="llm"))

        def pick_kv() -> Awaitable[object]:
            return rstub.Pick(
                router_pb2.PickRequest(
                    role="llm",
                    strategy=router_pb2.STRATEGY_KV_AWARE,
                    kv_namespace=ECHO_LAYOUT.namespace_hex,
                    block_hashes=hashes,
                )
            )

        def bare() -> Awaitable[object]:
            return direct[0].GetLoad(worker_pb2.GetLoadRequest())

        noop = worker_pb2.InvokeRequest(operation="noop")
        role = (("x-omniflow-role", "llm"),)

        def proxied_invoke() -> Awaitable[object]:
            return proxy.Invoke(noop, metadata=role)

        def direct_invoke() -> Awaitable[object]:
            return direct[next(turn) % len(direct)].Invoke(noop)

        gen = worker_pb2.GenerateRequest(text="a b c d")

        async def proxied_gen() -> None:
            async for _ in proxy.Generate(gen):
                pass

        async def direct_gen() -> None:
            async for _ in direct[next(turn) % len(direct)].Generate(gen):
                pass

        for fn in (pick_rr, pick_kv, bare, proxied_invoke, direct_invoke, proxied_gen, direct_gen):
            await timed(fn, 200)  # warm up
        rows = [("metric", "ours", "reference", "ratio", "added")]
        row(
            rows,
            "Pick round_robin vs bare RPC",
            await timed(pick_rr, calls),
            await timed(bare, calls),
        )
        row(
            rows,
            "Pick kv_aware(32 blocks) vs bare",
            await timed(pick_kv, calls),
            await timed(bare, calls),
        )
        inv_p, inv_d = await timed(proxied_invoke, calls), await timed(direct_invoke, calls)
        row(rows, "proxy Invoke vs direct", inv_p, inv_d)
        row(
            rows,
            "proxy Generate vs direct",
            await timed(proxied_gen, calls // 2),
            await timed(direct_gen, calls // 2),
        )
        show(rows)
        rows = [("throughput (32 in flight)", "proxy req/s", "direct req/s", "ratio")]
        for label, a_fn, b_fn in (
            ("Invoke", proxied_invoke, direct_invoke),
            ("Generate", proxied_gen, direct_gen),
        ):
            a = await throughput(a_fn, calls * 2, 32)
            b = await throughput(b_fn, calls * 2, 32)
            rows.append((label, f"{a:.0f}", f"{b:.0f}", f"{a / b:.2f}x"))
        show(rows)
        return pct(inv_p, 0.5) - pct(inv_d, 0.5), pct(inv_p, 0.99) - pct(inv_d, 0.99)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_http(url: str, timeout_s: float = 60) -> None:
    import aiohttp

    end = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} did not answer")


async def peer_latency(worker_url: str, router_url: str, calls: int) -> tuple[list, list]:
    import aiohttp

    body = {"text": "a b c d", "sampling_params": {"max_new_tokens": 4}}
    async with aiohttp.ClientSession() as session:

        async def call(url: str) -> None:
            async with session.post(url + "/generate", json=body) as resp:
                await resp.read()
                assert resp.status == 200, resp.status

        for _ in range(200):
            await call(worker_url)
            await call(router_url)
        via = await timed(lambda: call(router_url), calls)
        direct = await timed(lambda: call(worker_url), calls)
    return via, direct


def peer(calls: int, our_added: tuple[float, float]) -> None:
    if importlib.util.find_spec("sglang_router") is None:
        print("peer: sglang_router is not installed (pip install sglang-router); skipped")
        return
    wport, rport = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # stderr quiet: the router's HTTP/2 probes show up there as 400s.
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", FAKE_HTTP_WORKER, str(wport)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        worker_url = f"http://127.0.0.1:{wport}"
        asyncio.run(wait_http(worker_url + "/health"))
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(rport),
                    "--worker-urls",
                    worker_url,
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "error",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        router_url = f"http://127.0.0.1:{rport}"
        asyncio.run(wait_http(router_url + "/health"))
        via, direct = asyncio.run(peer_latency(worker_url, router_url, calls))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    rows = [("added latency of a router hop", "p50 ms", "p99 ms")]
    rows.append(("ours: gRPC proxy (Invoke)", f"{our_added[0]:+.3f}", f"{our_added[1]:+.3f}"))
    rows.append(
        (
            "sglang-router 0.3 (HTTP /generate)",
            f"{pct(via, 0.5) - pct(direct, 0.5):+.3f}",
            f"{pct(via, 0.99) - pct(direct, 0.99):+.3f}",
        )
    )
    show(rows)
    print(
        f"  (sglang-router: direct p50 {pct(direct, 0.5):.3f} ms, via router "
        f"{pct(via, 0.5):.3f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    procs = Procs()
    os.environ.setdefault("OMNIFLOW_LOG_LEVEL", "WARNING")
    try:
        env = {"OMNIFLOW_ECHO_PUBLISH_KV": "1"}
        workers = [procs.worker(f"llm-{i}", "llm", **env) for i in range(2)]
        router = procs.start("omniflow_services.router", "router", OMNIFLOW_ROUTER_KV_INDEX="redis")
        added = asyncio.run(ours(router, workers, args.calls))
    finally:
        procs.close()
    peer(args.calls, added)


if __name__ == "__main__":
    main()
