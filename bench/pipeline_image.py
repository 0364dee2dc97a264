"""The image pipeline (examples/workflows/imagegen.py) end to end, on two nodes.

Real processes on one machine: kv-index, router, coordinator, and two nodes, each with a
kv-agent, an llm worker and a diffusion worker (SmolLM2-135M-Instruct and the generated
image head over its backbone; ``--tiny`` for the tiny test models). Three variants of one
workflow run on distinct prompts, interleaved so that drift hits them alike:

- ``kv_aware`` (the workflow as shipped): the final prompt is prefilled ``prefill_only``
  and the diffusion call, placed by the pages' block hashes, pulls them on its own node;
- ``round_robin``: the same, the diffusion call placed round robin (half the time on the
  other node: the pages come agent to agent across nodes);
- ``recompute``: no prefill_only call; the diffusion worker prefills the prompt itself.

Rows: workload, metric, value, baseline, ratio (value / baseline).

    python bench/pipeline_image.py               # SmolLM2, 6 prompts per variant
    python bench/pipeline_image.py --tiny --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.client import Client, RunResult
from omniflow.dsl import VType, Workflow
from omniflow.models.resolve import resolve_model
from omniflow.testing.nodes import Nodes, WorkerSpec, start_nodes

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "examples" / "workflows" / "imagegen.py"
SUBJECTS = ("lighthouse", "fox", "harbor", "garden", "windmill", "glacier", "market", "tram")
PLACES = ("at dusk", "in the snow", "in the fog", "at noon", "by the sea", "in spring")
DEFAULT_MODELS = "~/.cache/omniflow/models"
MODELS = {
    "smollm2": ("smollm2-135m-instruct", "smollm2-135m-diffusion"),
    "tiny": ("tiny:qwen2", "tiny:diffusion"),
}


@dataclass
class Variant:
    name: str
    placement: str
    reuse_pages: bool
    e2e_ms: list[float] = field(default_factory=list)
    draw_ms: list[float] = field(default_factory=list)
    local: list[bool] = field(default_factory=list)  # draw on the node of the pages
    cached: list[float] = field(default_factory=list)  # share of the prompt pulled


def _prompt(variant: int, i: int) -> str:
    # Distinct per variant and run: no variant profits from another's pages.
    k = variant * 101 + i
    return f"a {SUBJECTS[k % len(SUBJECTS)]} {PLACES[k % len(PLACES)]}, scene {k}"


def _worker(result: RunResult, node: str) -> str:
    ids = [
        e.node_started.worker_id
        for e in result.events
        if e.HasField("node_started") and e.node_started.node == node
    ]
    return ids[-1] if ids else ""


def _took(result: RunResult, node: str) -> float:
    for e in result.events:
        if e.HasField("node_finished") and e.node_finished.node == node:
            return e.node_finished.duration_ms
    return float("nan")


async def _run(client: Client, nodes: Nodes, v: Variant, prompt: str, size: dict) -> None:
    start = time.perf_counter()
    result = await client.run(v.name, {"prompt": prompt, **size})
    took = (time.perf_counter() - start) * 1e3
    if not result.ok:
        raise RuntimeError(f"{v.name}: {result.error}")
    out = result.outputs
    v.e2e_ms.append(took)
    v.draw_ms.append(_took(result, "draw"))
    v.cached.append(out["cached_prompt_tokens"] / max(out["prompt_tokens"], 1))
    if v.reuse_pages:
        prefill, draw = _worker(result, "prefill"), _worker(result, "draw")
        v.local.append(nodes.node_of.get(prefill) == nodes.node_of.get(draw))


def _pages_only(name: str, placement: str) -> Workflow:
    """prefill_only then generate_image at once: the placement alone, no rewrite."""
    wf = Workflow(name, deadline_ms=120_000)
    pre = wf.call("prefill", "llm", "generate", prompt=wf.input("prompt", VType.TEXT),
                  params={"chat": True, "prefill_only": True})  # fmt: skip
    draw = wf.call("draw", "diffusion", "generate_image", pages=pre["pages"],
                   width=wf.input("width", VType.INT), height=wf.input("height", VType.INT),
                   steps=wf.input("steps", VType.INT), strategy=placement)  # fmt: skip
    wf.output("prompt_tokens", draw["prompt_tokens"])
    wf.output("cached_prompt_tokens", draw["cached_prompt_tokens"])
    return wf


def _long_prompt(variant: int, i: int) -> str:
    return " ".join(_prompt(variant * 7 + j, i) for j in range(5))


def _models_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get("OMNIFLOW_MODELS_DIR", DEFAULT_MODELS)))


def _topology(model: str) -> dict[str, list[WorkerSpec]]:
    llm, diffusion = MODELS[model]
    return {
        node: [
            WorkerSpec(f"llm-{node}", "llm", llm),
            WorkerSpec(f"diffusion-{node}", "diffusion", diffusion),
        ]
        for node in ("node-a", "node-b")
    }


def _rows(variants: dict[str, Variant], model: str) -> list[list[str]]:
    kv, rr, rc = variants["kv_aware"], variants["round_robin"], variants["recompute"]
    pk, pr = variants["pages_kv_aware"], variants["pages_round_robin"]
    med = statistics.median
    work = f"imagegen ({model}, 2 nodes)"
    only = f"prefill_only -> diffusion ({model}, 2 nodes)"

    def row(workload: str, metric: str, value: float, base: float, fmt: str) -> list[str]:
        ratio = f"{value / base:.2f}" if base else "-"
        return [workload, metric, format(value, fmt), format(base, fmt), ratio]

    hit_kv = sum(kv.local) / len(kv.local)
    hit_rr = sum(rr.local) / len(rr.local)
    return [
        row(work, "end-to-end p50 ms (pages reused vs recomputed)", med(kv.e2e_ms),
            med(rc.e2e_ms), ".0f"),
        row(work, "diffusion call p50 ms (pages reused vs recomputed)", med(kv.draw_ms),
            med(rc.draw_ms), ".0f"),
        row(work, "prompt tokens pulled, share (reused vs recomputed)", med(kv.cached),
            med(rc.cached), ".2f"),
        row(work, "diffusion on the pages' node (kv_aware vs round_robin)", hit_kv, hit_rr,
            ".2f"),
        row(work, "prompt tokens pulled, mean share (kv_aware vs round_robin)",
            statistics.mean(kv.cached), statistics.mean(rr.cached), ".2f"),
        row(work, "diffusion call p50 ms (kv_aware vs round_robin)", med(kv.draw_ms),
            med(rr.draw_ms), ".0f"),
        row(work, "end-to-end p50 ms (kv_aware vs round_robin)", med(kv.e2e_ms),
            med(rr.e2e_ms), ".0f"),
        row(only, "diffusion on the pages' node (kv_aware vs round_robin)",
            sum(pk.local) / len(pk.local), sum(pr.local) / len(pr.local), ".2f"),
        row(only, "prompt tokens pulled, mean share (kv_aware vs round_robin)",
            statistics.mean(pk.cached), statistics.mean(pr.cached), ".2f"),
        row(only, "diffusion call p50 ms (kv_aware vs round_robin)", med(pk.draw_ms),
            med(pr.draw_ms), ".0f"),
    ]  # fmt: skip


async def measure(args: Any) -> list[list[str]]:
    """The table rows (workload, metric, value, baseline, ratio). Reads from ``args``, each
    optional: ``image_runs`` (prompts per variant, default 6), ``tiny`` (the tiny models),
    ``image_size`` (pixels, default 64), ``image_steps`` (default 4)."""
    runs = int(getattr(args, "image_runs", 6) or 6)
    model = "tiny" if getattr(args, "tiny", False) else "smollm2"
    px = int(getattr(args, "image_size", 64) or 64)
    size = {"width": px, "height": px, "steps": int(getattr(args, "image_steps", 4) or 4)}
    models = _models_dir()
    for spec in MODELS[model]:
        await asyncio.to_thread(resolve_model, spec, models)  # pulled once, before the workers
    build = runpy.run_path(str(WORKFLOW))["build"]
    variants = {
        "kv_aware": Variant("imagegen_kv_aware", "kv_aware", True),
        "round_robin": Variant("imagegen_round_robin", "round_robin", True),
        "recompute": Variant("imagegen_recompute", "kv_aware", False),
    }
    root = Path(tempfile.mkdtemp(prefix="omniflow-bench-image-"))
    threads = {"OMNIFLOW_WORKER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
               "OMNIFLOW_LOG_LEVEL": "WARNING"}  # fmt: skip
    nodes = await asyncio.to_thread(
        start_nodes, root, _topology(model), models_dir=models, env=threads
    )
    try:
        async with Client(nodes.addresses["coordinator"]) as client:
            for v in variants.values():
                await client.register(
                    build(v.name, placement=v.placement, reuse_pages=v.reuse_pages)
                )
            # One untimed run per variant: first calls load tokenizers and warm the engines.
            for k, v in enumerate(variants.values()):
                await _run(client, nodes, Variant(v.name, v.placement, v.reuse_pages),
                           f"warm-up {k}: a small boat", size)  # fmt: skip
            for i in range(runs):
                for k, v in enumerate(variants.values()):
                    await _run(client, nodes, v, _prompt(k, i), size)
            # The placement alone, twice as many runs (they are short).
            pages = {p: Variant(f"pages_{p}", p, True) for p in ("kv_aware", "round_robin")}
            for v in pages.values():
                await client.register(_pages_only(v.name, v.placement))
            for i in range(2 * runs):
                for k, v in enumerate(pages.values()):
                    await _run(client, nodes, v, _long_prompt(k, i), size)
            variants.update({v.name: v for v in pages.values()})
    finally:
        await asyncio.to_thread(nodes.stop)
    return _rows(variants, model)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image-runs", type=int, default=6, help="prompts per variant")
    p.add_argument("--tiny", action="store_true", help="the tiny test models, not SmolLM2")
    p.add_argument("--image-size", type=int, default=64, help="width and height, pixels")
    p.add_argument("--image-steps", type=int, default=4, help="denoising steps")
    args = p.parse_args()
    started = time.monotonic()
    rows = asyncio.run(measure(args))
    header = ["workload", "metric", "value", "baseline", "ratio"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"wall {time.monotonic() - started:.0f} s; load average {load}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
