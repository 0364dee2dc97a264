"""Time per denoising step: the prompt's K/V reused from the engine vs recomputed each step.

The image head runs the backbone over the timestep token and the image's latent tokens;
with reuse they attend to the prompt K/V the engine prefilled once, without it the prompt
is run through the backbone again at every step (same weights, same latents: the maximum
difference is printed). The prompt is ``--ratio`` times the image tokens (default 4).

    python bench/mm_denoise.py                      # 6 layers, hidden 384, 128x128 image
    python bench/mm_denoise.py --size 64 --steps 4  # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omniflow.models import make_tiny
from omniflow.models.tiny_mm import make_image_head
from omniflow_services.worker.engine import Engine, EngineConfig
from omniflow_services.worker.mm.diffusion import initial_noise
from omniflow_services.worker.mm.image_role import DiffusionRole


def _time(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


async def main_async(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        backbone = make_tiny(
            "qwen2", root / "bb", layers=args.layers, hidden=args.hidden, heads=args.heads,
            kv_heads=args.kv_heads, vocab=512,
        )  # fmt: skip
        head_dir = make_image_head(
            root / "head", backbone=str(backbone), backbone_hidden=args.hidden
        )
        engine = Engine(backbone, EngineConfig(num_pages=256))
        role = await DiffusionRole.load(head_dir, engine)
        head = role.head
        shape = head.latent_shape(args.size, args.size)
        image_tokens = (args.size // head.pixels_per_token) ** 2
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 500, (args.ratio * image_tokens,), generator=g).tolist()
        kv, _ = await role.prefill("bench", prompt)
        x = initial_noise(shape, 0)
        reuse = _time(lambda: head.velocity(x, 0.5, kv), args.repeat)
        recompute = _time(lambda: head.velocity_recompute(x, 0.5, prompt), args.repeat)
        diff = (head.velocity(x, 0.5, kv) - head.velocity_recompute(x, 0.5, prompt)).abs().max()
    print(
        f"backbone: {args.layers} layers, hidden {args.hidden}; image {args.size}x{args.size} = "
        f"{image_tokens} latent tokens + 1 timestep token; prompt {len(prompt)} tokens "
        f"({args.ratio}x); median of {args.repeat}"
    )
    print(f"{'denoising step':<34}{'ms/step':>10}")
    print(f"{'prompt K/V reused (ours)':<34}{reuse * 1000:>10.2f}")
    print(f"{'prompt recomputed every step':<34}{recompute * 1000:>10.2f}")
    print(f"{'ratio reused/recomputed':<34}{reuse / recompute:>10.2f}   (target <= 0.5)")
    print(f"max |v_reused - v_recomputed| = {float(diff):.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--size", type=int, default=128, help="image side in pixels (16 per token)")
    p.add_argument("--ratio", type=int, default=4, help="prompt tokens per image token")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
