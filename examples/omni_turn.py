"""An omni-modal dialogue turn: an image in, text and speech out, against the local topology.

    omniflow up
    python examples/omni_turn.py --image photo.png --out out/   # or no --image: a test card

1. the encoder turns the image into embeddings, kept in the kv-agent (a TensorRef);
2. the llm answers the question about it, reading the embeddings from the data plane;
3. the talker speaks the answer, streamed in chunks.

Writes ``answer.txt`` and ``answer.wav`` to ``--out``. ``--turns 2`` asks a second
question on the same image: its prompt pages through the image span come from the cache.
The router picks each worker (lookaside: Pick, then a direct call).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
from pathlib import Path

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.cli.local import local_address
from omniflow.rpc.client import open_channel

QUESTIONS = ("What is in this picture?", "Describe its colours in one sentence.")


def test_card(size: int = 64) -> bytes:
    """A colourful PNG to use when no image is given."""
    from PIL import Image

    img = Image.new("RGB", (size, size))
    img.putdata(
        [(x * 4 % 256, y * 4 % 256, (x + y) * 2 % 256) for y in range(size) for x in range(size)]
    )
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


async def pick(router: str, role: str, operation: str) -> str:
    async with open_channel(router, default_timeout_s=5.0) as channel:
        reply = await router_pb2_grpc.RouterServiceStub(channel).Pick(
            router_pb2.PickRequest(role=role, operation=operation)
        )
    return reply.worker.address


async def turn(
    router: str, image: bytes, question: str, max_tokens: int
) -> tuple[str, common_pb2.Usage]:
    enc_addr = await pick(router, "encoder", "encode")
    async with open_channel(enc_addr, default_timeout_s=60.0) as ch:
        encoded = await worker_pb2_grpc.WorkerServiceStub(ch).Encode(
            worker_pb2.EncodeRequest(
                items=[common_pb2.MediaItem(kind=common_pb2.MediaItem.KIND_IMAGE, data=image)]
            )
        )
    item = encoded.items[0]
    print(
        f"[encoder {enc_addr}: item {item.item_id.hex()[:12]}, embeddings "
        f"{list(item.embeddings.shape)} held by agent {item.embeddings.address}, "
        f"cache hits {encoded.cache_hits}]",
        file=sys.stderr,
    )
    llm_addr = await pick(router, "llm", "generate")
    request = worker_pb2.GenerateRequest(
        messages=worker_pb2.ChatMessages(
            messages=[
                worker_pb2.ChatMessage(
                    role="user",
                    content=[
                        worker_pb2.ContentPart(encoded=item),
                        worker_pb2.ContentPart(text=question),
                    ],
                )
            ],
            add_generation_prompt=True,
        ),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    text = []
    usage = common_pb2.Usage()
    async with open_channel(llm_addr, default_timeout_s=120.0) as ch:
        async for chunk in worker_pb2_grpc.WorkerServiceStub(ch).Generate(request):
            text.append(chunk.text)
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                usage = chunk.usage
    print(
        f"\n[llm {llm_addr}: {usage.prompt_tokens} prompt tokens, {usage.cached_tokens} cached]",
        file=sys.stderr,
    )
    return "".join(text), usage


async def speak(router: str, text: str) -> bytes:
    """The talker's WAV of ``text`` (chunks stream in; the last one carries the file)."""
    addr = await pick(router, "talker", "synthesize")
    chunks, wav = 0, b""
    async with open_channel(addr, default_timeout_s=120.0) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        async for c in stub.Synthesize(worker_pb2.SynthesizeRequest(text=text, seed=0)):
            chunks += 1
            wav = c.wav if c.last else wav
    print(f"[talker {addr}: {chunks} chunks, {len(wav)} bytes of WAV]", file=sys.stderr)
    return wav


async def run(router: str, image: bytes, turns: int, max_tokens: int) -> tuple[str, bytes]:
    answer = ""
    for i in range(turns):
        answer, _ = await turn(router, image, QUESTIONS[i % len(QUESTIONS)], max_tokens)
    return answer, await speak(router, answer or "I see a picture.")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--image", help="PNG or JPEG file (default: a generated test card)")
    parser.add_argument("--out", default="out", help="folder for answer.txt and answer.wav")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--router", help="router address (default: the local topology's)")
    args = parser.parse_args()
    router = args.router or local_address("router")
    if router is None:
        print("no router: start the topology with `omniflow up` or pass --router", file=sys.stderr)
        return 2
    image = Path(args.image).read_bytes() if args.image else test_card()
    answer, wav = asyncio.run(run(router, image, args.turns, args.max_tokens))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "answer.txt").write_text(answer)
    (out / "answer.wav").write_bytes(wav)
    print(out / "answer.txt")
    print(out / "answer.wav")
    return 0


if __name__ == "__main__":
    sys.exit(main())
