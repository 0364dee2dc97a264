"""Resident memory: one process serving the LLM and diffusion roles on one backbone, against
two processes (an LLM worker and a diffusion worker) each holding its own copy.

A diffusion worker loads the image head on top of an LLM engine over the backbone, and that
engine also serves text generation: one process, one copy of the weights. The reference is
the split deployment: an LLM worker process plus a diffusion worker process. Each child
process loads its roles with the worker's own loading code, runs one request of each kind,
then reports its VmRSS (and VmHWM) from /proc.

    python bench/mm_memory.py                      # 8 layers, hidden 1024 (~100M params)
    python bench/mm_memory.py --hidden 512         # smaller
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _rss_kib() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(val.split()[0])
    return out


async def _child(kind: str, head: str, backbone: str) -> None:
    from omniflow_services.worker.engine import EngineConfig, SamplingParams
    from omniflow_services.worker.engine.role import EngineRole
    from omniflow_services.worker.mm.image_role import ImageRequest
    from omniflow_services.worker.mm.loading import load_roles

    config = EngineConfig(kv_cache_bytes=16 * 1024 * 1024)
    if kind == "llm":
        llm = await EngineRole.load(Path(backbone), config)
        await llm.warm_up()
        image = None
    else:  # diffusion: its engine over the backbone also serves Generate
        roles = await load_roles("diffusion", head, Path(head).parent, config)
        llm, image = roles.llm, roles.diffusion
        assert llm is not None and image is not None
        await image.generate(ImageRequest("m", [5, 6, 7, 8], [1, 2], 64, 64, 2, 2.0, 0))
    async for _ in llm.generate("t", list(range(3, 40)), SamplingParams(4, 0.0)):
        pass
    print(json.dumps(_rss_kib()))


def _run(kind: str, head: Path, backbone: Path) -> dict[str, int]:
    cmd = [sys.executable, __file__, "--child", kind, "--head", str(head), "--bb", str(backbone)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--child", choices=("llm", "diffusion"), help=argparse.SUPPRESS)
    p.add_argument("--head", help=argparse.SUPPRESS)
    p.add_argument("--bb", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        asyncio.run(_child(args.child, args.head, args.bb))
        return
    from omniflow.models import make_tiny
    from omniflow.models.tiny_mm import make_image_head

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bb = make_tiny("qwen2", root / "backbone", layers=args.layers, hidden=args.hidden,
                       heads=8, kv_heads=2, vocab=512)  # fmt: skip
        head = make_image_head(root / "head", backbone="../backbone", backbone_hidden=args.hidden)
        weights = (bb / "model.safetensors").stat().st_size / 2**20
        one = _run("diffusion", head, bb)
        llm = _run("llm", head, bb)
    two = {k: one[k] + llm[k] for k in one}
    print(f"backbone: {args.layers} layers, hidden {args.hidden}, {weights:.0f} MiB of weights")
    print(f"{'deployment':<44}{'RSS MiB':>10}{'peak MiB':>10}")
    print(f"{'one process: llm + diffusion (ours)':<44}{one['VmRSS'] / 1024:>10.0f}"
          f"{one['VmHWM'] / 1024:>10.0f}")  # fmt: skip
    print(f"{'two processes: llm, diffusion (own copies)':<44}{two['VmRSS'] / 1024:>10.0f}"
          f"{two['VmHWM'] / 1024:>10.0f}")  # fmt: skip
    print(f"{'ratio one/two':<44}{one['VmRSS'] / two['VmRSS']:>10.2f}"
          f"{one['VmHWM'] / two['VmHWM']:>10.2f}   (target ~0.5)")  # fmt: skip


if __name__ == "__main__":
    main()
