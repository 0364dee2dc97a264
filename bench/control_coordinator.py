"""Coordinator overhead: a chain of 8 nodes whose operation returns at once, run by the
coordinator, against the same 8 calls made directly by a client.

Ours: ``RunWorkflow`` of an 8-node chain of ``echo.noop`` (the echo TEST worker's
Invoke that returns its input); each hop is a ``Pick`` on the router, the worker call,
and the run's events. Reference: the client calls ``Invoke(noop)`` 8 times in a row on
the same worker. Real processes on 127.0.0.1 (router, coordinator, one worker), runs
interleaved with reference blocks. Target: <= 1 ms added per hop at p50.

The machine is shared and noisy: the whole measurement is repeated (fresh processes
each time, ``--repeat``) with the load average noted, and the table shows the median
repetition (by added time per hop).

    python bench/control_coordinator.py [--runs 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from control_common import Procs, pct

from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.client import Client
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.rpc.client import open_channel
from omniflow.values import from_python

HOPS = 8


def chain() -> Workflow:
    register_operation("echo", "noop", {"text": VType.TEXT}, {"text": VType.TEXT})
    wf = Workflow("bench_chain8")
    value = wf.input("text", VType.TEXT)
    for i in range(HOPS):
        value = wf.call(f"n{i}", "echo", "noop", text=value)["text"]
    wf.output("text", value)
    return wf


async def bench(
    coordinator: str, worker: str, runs: int, block: int
) -> tuple[list[float], list[float]]:
    async with Client(coordinator) as client, open_channel(worker) as channel:
        await client.register(chain())
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb2.InvokeRequest(operation="noop", inputs={"text": from_python("x")})

        async def direct() -> float:
            t0 = time.perf_counter()
            for _ in range(HOPS):
                await stub.Invoke(request)
            return (time.perf_counter() - t0) * 1e3

        async def through() -> float:
            t0 = time.perf_counter()
            result = await client.run("bench_chain8", {"text": "x"})
            assert result.ok, result.error
            return (time.perf_counter() - t0) * 1e3

        for _ in range(30):  # warm up
            await direct()
            await through()
        ours: list[float] = []
        ref: list[float] = []
        while len(ours) < runs:
            for _ in range(block):
                ours.append(await through())
            for _ in range(block):
                ref.append(await direct())
    return ours, ref


def added_per_hop(ours: list[float], ref: list[float]) -> float:
    return (pct(ours, 0.5) - pct(ref, 0.5)) / HOPS


def table(ours: list[float], ref: list[float]) -> None:
    rows = [("metric", "coordinator (8 hops)", "direct 8 calls", "ratio", "added per hop")]
    for label, q in (("p50 ms", 0.5), ("p90 ms", 0.9), ("p99 ms", 0.99)):
        a, b = pct(ours, q), pct(ref, q)
        rows.append((label, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}x", f"{(a - b) / HOPS:.3f} ms"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    added = added_per_hop(ours, ref)
    print(
        f"\nadded per hop at p50: {added:.3f} ms (target <= 1 ms): "
        f"{'MET' if added <= 1.0 else 'NOT MET'}"
    )


def measure(runs: int, block: int) -> tuple[list[float], list[float]]:
    procs = Procs()
    try:
        worker = procs.worker("echo-0", "echo")
        router = procs.start("omniflow_services.router", "router")
        coordinator = procs.start(
            "omniflow_services.coordinator", "coordinator", OMNIFLOW_ROUTER_ADDR=router
        )
        return asyncio.run(bench(coordinator, worker, runs, block))
    finally:
        procs.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3, help="measurements, fresh processes")
    args = parser.parse_args()
    results = []
    for i in range(args.repeat):
        load = os.getloadavg()[0]
        ours, ref = measure(args.runs, args.block)
        results.append((added_per_hop(ours, ref), ours, ref))
        print(
            f"repetition {i + 1}: added per hop at p50 {results[-1][0]:.3f} ms "
            f"(coordinator {pct(ours, 0.5):.2f} ms, direct {pct(ref, 0.5):.2f} ms; "
            f"load average {load:.2f})"
        )
    results.sort(key=lambda r: r[0])
    _, ours, ref = results[len(results) // 2]
    print(f"\nmedian of {len(results)} repetitions:")
    table(ours, ref)


if __name__ == "__main__":
    main()
