"""Time to first token of a second turn on a long history, with the history's KV:

- reused from the same worker's device pool,
- pulled from another worker's pages through the agents (the first turn ran on node a,
  the second runs on node b: b's agent pulls a's pages agent to agent, b's engine imports
  them),
- recomputed (a history no one has seen).

Real processes on 127.0.0.1: Redis, kv-index, two kv-agents (node-a, node-b), one llm
worker per node, all on the same generated model (8 layers, hidden 512 by default).
TTFT is measured by the client: from sending Generate to the first streamed chunk.
Targets: same-worker reuse >= 10x faster than recompute; cross-worker >= 4x.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from control_common import Procs

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.kv.blocks import block_hashes
from omniflow.models import make_tiny
from omniflow.rpc.client import open_channel


async def ttft(address: str, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first chunk of a 1-token generation, and the cached prompt tokens."""
    request = worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True),
    )
    async with open_channel(address, default_timeout_s=600) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        t0 = time.perf_counter()
        first = None
        cached = 0
        async for chunk in stub.Generate(request):
            if first is None:
                first = time.perf_counter() - t0
            if chunk.finish_reason:
                cached = chunk.usage.cached_tokens
    assert first is not None
    return first, cached


async def wait_announced(index: str, namespace: str, hashes: list[bytes], owner: str) -> None:
    async with open_channel(index) as channel:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            reply = await stub.MatchPrefix(
                kvindex_pb2.MatchPrefixRequest(namespace=namespace, block_hashes=hashes)
            )
            if any(o.owner_id == owner and o.matched_blocks == len(hashes) for o in reply.owners):
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{owner} never announced the history's {len(hashes)} pages")


async def run(args: argparse.Namespace, procs: Procs) -> None:
    model = make_tiny(
        "qwen2",
        procs.dir / "model",
        layers=args.layers,
        hidden=args.hidden,
        heads=8,
        kv_heads=4,
        vocab=4096,
        max_position=args.history + 1024,
    )
    print(f"model: {args.layers} layers, hidden {args.hidden} at {model}", flush=True)
    index = procs.start("omniflow_services.kv_index", "kv-index")
    agents = {}
    for node in ("a", "b"):
        agents[node] = procs.start(
            "omniflow_services.kv_agent",
            f"agent-{node}",
            OMNIFLOW_NODE_ID=f"node-{node}",
            OMNIFLOW_KV_INDEX_ADDR=index,
            OMNIFLOW_KV_HOST_BYTES=str(1024 * 1024 * 1024),
        )
    workers = {}
    for node in ("a", "b"):
        workers[node] = procs.start(
            "omniflow_services.worker",
            f"llm-{node}",
            OMNIFLOW_NODE_ID=f"node-{node}",
            OMNIFLOW_WORKER_MODEL=str(model),
            OMNIFLOW_KV_AGENT_ADDR=agents[node],
            OMNIFLOW_WORKER_KV_BYTES=str(1024 * 1024 * 1024),
            OMNIFLOW_WORKER_MAX_BATCH_TOKENS=str(args.chunk),
        )
    async with open_channel(workers["a"]) as channel:
        info = await worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    namespace = info.info.kv_namespace
    print("topology up: kv-index, agents on node-a/node-b, one llm worker each", flush=True)

    import random

    rng = random.Random(0)

    def history() -> list[int]:
        return [rng.randrange(3, 4096) for _ in range(args.history)]

    turn = [rng.randrange(3, 4096) for _ in range(args.turn)]
    times: dict[str, list[float]] = {"same worker": [], "cross worker": [], "recompute": []}
    cached: dict[str, list[int]] = {k: [] for k in times}
    for rep in range(args.repeat):
        # Recompute: a history nobody has seen, second turn included.
        t, c = await ttft(workers["b"], history() + turn)
        times["recompute"].append(t)
        cached["recompute"].append(c)
        # Same worker: turn 1 on a, turn 2 on a.
        h = history()
        await ttft(workers["a"], h)
        t, c = await ttft(workers["a"], h + turn)
        times["same worker"].append(t)
        cached["same worker"].append(c)
        # Cross worker: turn 1 on a (pages written through to agent a), turn 2 on b.
        h = history()
        await ttft(workers["a"], h)
        hashes = block_hashes(bytes.fromhex(namespace), h, 16)
        await wait_announced(index, namespace, hashes, "agent-a")
        t, c = await ttft(workers["b"], h + turn)
        times["cross worker"].append(t)
        cached["cross worker"].append(c)
        print(
            f"  repeat {rep + 1}/{args.repeat}: "
            + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
            flush=True,
        )

    base = statistics.median(times["recompute"])
    print(
        f"\nturn-2 TTFT, history {args.history} tokens + {args.turn} new, median of {args.repeat}"
    )
    print("| history KV | TTFT (ms) | cached prompt tokens | speed-up vs recompute |")
    print("|---|---|---|---|")
    for name in ("same worker", "cross worker", "recompute"):
        med = statistics.median(times[name])
        print(f"| {name} | {med * 1e3:.1f} | {cached[name][-1]} | {base / med:.1f}x |")
    same = base / statistics.median(times["same worker"])
    cross = base / statistics.median(times["cross worker"])
    print(
        f"targets: same worker >= 10x ({'met' if same >= 10 else 'NOT met'}), "
        f"cross worker >= 4x ({'met' if cross >= 4 else 'NOT met'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history", type=int, default=4096)
    parser.add_argument("--turn", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    procs = Procs()
    try:
        asyncio.run(run(args, procs))
    finally:
        procs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
