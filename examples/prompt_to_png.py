"""Text to image on the LLM's backbone, against the local topology.

    omniflow up
    python examples/prompt_to_png.py "a lighthouse in a storm" --out out/lighthouse.png

The diffusion worker prefills the prompt once into KV pages (in the LLM's namespace) and
denoises the image latents over the same backbone, attending to those pages at every step.
With ``--via-llm`` an llm worker prefills the prompt first and the diffusion worker is sent
its prompt pages (token ids, namespace, block hashes) instead of the text.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.cli.local import local_address
from omniflow.rpc.client import open_channel


async def pick(router: str, role: str, operation: str) -> common_pb2.WorkerInfo:
    async with open_channel(router, default_timeout_s=5.0) as channel:
        reply = await router_pb2_grpc.RouterServiceStub(channel).Pick(
            router_pb2.PickRequest(role=role, operation=operation)
        )
    return reply.worker


async def prompt_pages(router: str, prompt: str) -> worker_pb2.PromptPages:
    """Prefill ``prompt`` on an llm worker: its full pages are cached and written through to
    the node's agent under the backbone's namespace; returns what names them."""
    llm = await pick(router, "llm", "generate")
    turn = worker_pb2.ChatMessage(role="user", content=[worker_pb2.ContentPart(text=prompt)])
    chat = worker_pb2.ChatMessages(messages=[turn], add_generation_prompt=True)
    async with open_channel(llm.address, default_timeout_s=60.0) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        req = worker_pb2.GenerateRequest(messages=chat, prefill_only=True)
        last = [c async for c in stub.Generate(req)][-1]
    print(
        f"[llm {llm.address}: prefilled {len(last.prompt_token_ids.ids)} tokens, "
        f"{len(last.prompt_block_hashes)} full pages]",
        file=sys.stderr,
    )
    return worker_pb2.PromptPages(
        token_ids=last.prompt_token_ids,
        kv_namespace=llm.kv_namespace,
        block_hashes=last.prompt_block_hashes,
    )


async def run(router: str, args: argparse.Namespace) -> bytes:
    worker = await pick(router, "diffusion", "generate_image")
    request = worker_pb2.GenerateImageRequest(
        width=args.width,
        height=args.height,
        steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
        negative_prompt=args.negative,
    )
    if args.via_llm:
        request.prompt_pages.CopyFrom(await prompt_pages(router, args.prompt))
    else:
        request.text = args.prompt
    async with open_channel(worker.address, default_timeout_s=300.0) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for i in range(args.repeat):
            reply = await stub.GenerateImage(request)
            print(
                f"[diffusion {worker.address}: {reply.width}x{reply.height}, "
                f"{reply.prompt_tokens} prompt tokens ({reply.cached_prompt_tokens} cached), "
                f"run {i + 1}]",
                file=sys.stderr,
            )
    return reply.png


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("prompt", nargs="?", default="a red fox in the snow at dawn")
    parser.add_argument("--out", default="out/image.png")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--negative", default="", help="negative prompt (the CFG unconditional)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="generate again: the prompt is cached"
    )
    parser.add_argument("--via-llm", action="store_true", help="prefill on an llm worker first")
    parser.add_argument("--router", help="router address (default: the local topology's)")
    args = parser.parse_args()
    router = args.router or local_address("router")
    if router is None:
        print("no router: start the topology with `omniflow up` or pass --router", file=sys.stderr)
        return 2
    png = asyncio.run(run(router, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
