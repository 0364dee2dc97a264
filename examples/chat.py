"""Stream a reply from an llm worker of the running topology.

    omniflow up                      # or: make up
    python examples/chat.py "Hello, Omni-Flow"

The router picks the worker (lookaside: Pick, then call the worker directly); the
reply streams token by token. ``--router`` names a router elsewhere; by default the
one `omniflow up` started is used.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.cli.local import local_address
from omniflow.rpc.client import open_channel


async def chat(router: str, text: str, max_tokens: int, temperature: float) -> int:
    async with open_channel(router, default_timeout_s=5.0) as channel:
        picked = await router_pb2_grpc.RouterServiceStub(channel).Pick(
            router_pb2.PickRequest(role="llm", operation="generate")
        )
    worker = picked.worker
    print(f"[{worker.worker_id} at {worker.address}, model {worker.model}]", file=sys.stderr)
    request = worker_pb2.GenerateRequest(
        messages=worker_pb2.ChatMessages(
            messages=[
                worker_pb2.ChatMessage(role="user", content=[worker_pb2.ContentPart(text=text)])
            ],
            add_generation_prompt=True,
        ),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature),
    )
    async with open_channel(worker.address, default_timeout_s=120.0) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        async for chunk in stub.Generate(request):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                u = chunk.usage
                reason = worker_pb2.FinishReason.Name(chunk.finish_reason)
                print(
                    f"\n[{reason}: {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
                    f"{u.completion_tokens} generated]",
                    file=sys.stderr,
                )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("text", nargs="?", default="Hello, Omni-Flow")
    parser.add_argument("--router", help="router address (default: the local topology's)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    router = args.router or local_address("router")
    if not router:
        print("no router: start the topology with `omniflow up` or pass --router", file=sys.stderr)
        return 1
    return asyncio.run(chat(router, args.text, args.max_tokens, args.temperature))


if __name__ == "__main__":
    sys.exit(main())
