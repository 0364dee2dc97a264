"""Time to first token of a second multimodal turn on the same image: reuse vs recompute.

Turn 1 is a system prompt, an image (the vision encoder's tokens) and a question; turn 2
repeats the conversation with the answer and a new question. With reuse the engine's prefix
cache serves every page through the image span (the same item id gives the same pages) and
the encoder is not called; the reference recomputes turn 2 from scratch: the image is
encoded again and the whole prompt prefilled. Both are measured in this run.

    python bench/mm_turn2.py
    python bench/mm_turn2.py --image-size 224 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from omniflow.chat import ChatTemplate
from omniflow.kv.blocks import item_id
from omniflow.models import make_tiny
from omniflow.models.tiny_mm import EncoderSize, make_vision_encoder
from omniflow_services.worker.engine import Engine, EngineConfig, SamplingParams
from omniflow_services.worker.mm.encoders import EncoderCache, EncoderRole, VisionEncoder
from omniflow_services.worker.mm.media import MediaInput
from omniflow_services.worker.mm.prompt import ItemEmbeddings, build_prompt, chat_segments

# The tiny llm's own chat template, read once its folder exists.
TEMPLATE: list[ChatTemplate] = []

SYSTEM = "You are a helpful assistant that looks at pictures and answers questions. " * 3


def _png(size: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


async def ttft(
    engine: Engine, encoder: EncoderRole, image: bytes, turns: list, rid: str
) -> tuple[float, int, int]:
    """Seconds from the request to its first token (encoding included when needed), the
    prompt's length and how many of its tokens came from the cache."""
    from omniflow_services.worker.engine import GenerateRequest

    start = time.perf_counter()
    media = MediaInput("image", image, "image")
    n = encoder.encoders["image"].tokens_per_image

    async def fetch() -> torch.Tensor:
        return (await encoder.encode([media]))[0].embeddings

    item = ItemEmbeddings(item_id(image), n, fetch)
    segs = chat_segments(
        [(r, [item if p is None else p for p in parts]) for r, parts in turns],
        True,
        TEMPLATE[0],
    )
    prompt = build_prompt(
        segs,
        lambda s: list(engine.tokenizer.encode(s).ids),
        engine.layout.page_size,
        asyncio.get_running_loop(),
        engine.model_config.hidden_size,
    )
    req = GenerateRequest(
        rid,
        prompt_token_ids=prompt.tokens,
        params=SamplingParams(max_tokens=1, temperature=0.0),
        extra_keys=prompt.extra_keys,
        embeds=prompt.embeds,
    )
    async for out in engine.generate(req):
        return time.perf_counter() - start, out.usage.prompt_tokens, out.usage.cached_tokens
    raise RuntimeError("no output")


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        llm = make_tiny("qwen2", root / "llm", layers=args.layers, hidden=args.hidden, heads=6,
                        kv_heads=2, vocab=512)  # fmt: skip
        size = EncoderSize(out_hidden=args.hidden, hidden=args.enc_hidden, layers=args.enc_layers,
                           heads=6)  # fmt: skip
        vis = make_vision_encoder(root / "vis", size, image_size=args.image_size, patch_size=14)
        cfg = EngineConfig(num_pages=512, max_num_batched_tokens=1024)
        TEMPLATE.append(ChatTemplate.from_folder(llm))
        cached = Engine(llm, cfg)
        fresh = Engine(llm, EngineConfig(num_pages=512, max_num_batched_tokens=1024,
                                         enable_prefix_cache=False))  # fmt: skip
        encoder = EncoderRole([VisionEncoder(vis)])
        image = _png(args.image_size)
        turn1 = [("system", [SYSTEM]), ("user", [None, "What is in this picture?"])]
        turn2 = [*turn1, ("assistant", ["A colourful pattern of random dots."]),
                 ("user", ["What colours stand out the most?"])]  # fmt: skip
        reuse, recompute = [], []
        for i in range(args.repeat):
            await ttft(cached, encoder, image, turn1, f"t1-{i}")  # turn 1 fills the cache
            t, plen, hit = await ttft(cached, encoder, image, turn2, f"t2-{i}")
            reuse.append(t)
            encoder.cache = EncoderCache()  # the reference encodes the image again
            recompute.append((await ttft(fresh, encoder, image, turn2, f"r-{i}"))[0])
    n = encoder.encoders["image"].tokens_per_image
    r, c = statistics.median(reuse), statistics.median(recompute)
    print(
        f"llm: {args.layers} layers, hidden {args.hidden}; image {args.image_size}px = {n} "
        f"tokens; turn 2: {plen} prompt tokens, {hit} from the cache; median of {args.repeat}"
    )
    print(f"{'turn 2 time to first token':<36}{'ms':>10}")
    print(f"{'image span reused (ours)':<36}{r * 1000:>10.2f}")
    print(f"{'recomputed (encode + full prefill)':<36}{c * 1000:>10.2f}")
    print(f"{'speed-up':<36}{c / r:>10.1f}x  (target >= 5x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--enc-layers", type=int, default=4)
    p.add_argument("--enc-hidden", type=int, default=384)
    p.add_argument("--image-size", type=int, default=224, help="pixels; 14-pixel patches")
    p.add_argument("--repeat", type=int, default=5)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
