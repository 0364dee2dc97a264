"""The image pipeline as a workflow (examples/workflows/imagegen.py), on two nodes of real
processes: kv-index, router, coordinator, and per node a kv-agent, an llm worker and a
diffusion worker (tiny qwen2 backbone, its generated image head), on a private Redis.

Run through the Python client and the CLI, every run returns a PNG whose prompt was pulled
as pages (every full page of the prompt but the one holding its last token, which the
diffusion engine computes), and the diffusion call lands on the node whose llm prefilled
those pages (the round-robin default of the role would alternate between the nodes)."""

from __future__ import annotations

import io
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniflow.api.router.v1 import router_pb2
from omniflow.client import Client, RunResult
from omniflow.dsl import VType, Workflow
from omniflow.models.resolve import resolve_model
from omniflow.testing.nodes import Nodes, WorkerSpec, start_nodes

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "examples" / "workflows" / "imagegen.py"
PAGE = 16  # the tiny backbone's page size
SIZE = {"width": 32, "height": 32, "steps": 2}
PROMPTS = ("a lighthouse at dusk", "a red fox in the snow", "a harbor in the fog", "a quiet garden")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[Nodes]:
    pytest.importorskip("PIL", reason="image encoding needs Pillow (the worker extra)")
    models = tmp_path_factory.mktemp("imagegen-models")
    for spec in ("tiny:qwen2", "tiny:diffusion"):
        resolve_model(spec, models)  # once, before four workers look for them
    topology = {
        node: [
            WorkerSpec(f"llm-{node}", "llm", "tiny:qwen2"),
            WorkerSpec(f"diffusion-{node}", "diffusion", "tiny:diffusion"),
        ]
        for node in ("node-a", "node-b")
    }
    n = start_nodes(
        tmp_path_factory.mktemp("imagegen-nodes"),
        topology,
        models_dir=models,
        redis_binary=redis_binary,
        env={"OMNIFLOW_WORKER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    yield n
    n.stop()


def _where(result: RunResult, node: str) -> str:
    started = [e.node_started for e in result.events if e.HasField("node_started")]
    workers = [s.worker_id for s in started if s.node == node and s.worker_id]
    assert workers, f"node {node} never started: {[s.node for s in started]}"
    return workers[-1]


def _check_image(png: bytes, width: int, height: int) -> None:
    from PIL import Image

    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.size == (width, height)


def _full_pages(prompt_tokens: int) -> int:
    # Every full page but the one holding the last token (the engine computes that token).
    return (prompt_tokens - 1) // PAGE * PAGE


async def test_imagegen_through_the_client_reuses_the_pages_where_they_are(nodes: Nodes) -> None:
    imagegen = runpy.run_path(str(WORKFLOW))["imagegen"]
    placed: list[tuple[str, str]] = []
    async with Client(nodes.addresses["coordinator"]) as client:
        await client.register(imagegen)
        for i, prompt in enumerate(PROMPTS):
            result = await client.run("imagegen", {"prompt": prompt, **SIZE, "seed": i})
            assert result.ok, result.error
            out = result.outputs
            _check_image(out["image"], 32, 32)
            assert (out["width"], out["height"]) == (32, 32)
            assert isinstance(out["prompt_used"], str) and out["prompt_used"]
            assert out["prompt_tokens"] > 2 * PAGE, out
            assert out["cached_prompt_tokens"] == _full_pages(out["prompt_tokens"]), out
            prefill, draw = _where(result, "prefill"), _where(result, "draw")
            placed.append((prefill, draw))
    # The diffusion call ran on the node whose llm stored the prompt's pages, every time.
    wrong = [(p, d) for p, d in placed if nodes.node_of[p] != nodes.node_of[d]]
    assert not wrong, f"diffusion calls off the node holding their pages: {wrong} of {placed}"


async def test_prefill_only_then_generate_image_at_once_20_times(nodes: Nodes) -> None:
    # The two calls back to back through the coordinator, 20 times, each prompt new: the
    # prefill_only reply is the promise that its pages can be pulled, so every full page
    # is reused every time (no wait, no retry between the calls), on the pages' node.
    wf = Workflow("pages_then_image", deadline_ms=120_000)
    prompt = wf.input("prompt", VType.TEXT)
    pre = wf.call("prefill", "llm", "generate", prompt=prompt,
                  params={"chat": True, "prefill_only": True})  # fmt: skip
    draw = wf.call("draw", "diffusion", "generate_image", pages=pre["pages"],
                   params={"width": 32, "height": 32, "steps": 1}, strategy="kv_aware")  # fmt: skip
    wf.output("prompt_tokens", draw["prompt_tokens"])
    wf.output("cached", draw["cached_prompt_tokens"])
    wf.output("blocks", pre["prompt_tokens"])
    short, placed = [], []
    async with Client(nodes.addresses["coordinator"]) as client:
        await client.register(wf)
        for i in range(20):
            text = f"picture {i}: " + " ".join(f"{w} {i}-{k}" for k, w in enumerate(PROMPTS * 4))
            result = await client.run("pages_then_image", {"prompt": text})
            assert result.ok, result.error
            out = result.outputs
            assert out["prompt_tokens"] == out["blocks"] > 4 * PAGE, out
            if out["cached"] != _full_pages(out["prompt_tokens"]):
                short.append((i, out["cached"], _full_pages(out["prompt_tokens"])))
            prefill, drawn = _where(result, "prefill"), _where(result, "draw")
            placed.append(nodes.node_of[prefill] == nodes.node_of[drawn])
    assert not short, f"runs that pulled fewer than every full page (run, pulled, full): {short}"
    assert all(placed), placed


async def test_imagegen_without_pages_recomputes_the_prompt(nodes: Nodes) -> None:
    # The same pipeline, the diffusion worker prefilling the prompt itself: nothing reused
    # for a prompt it has not seen (the comparison bench/pipeline_image.py measures).
    fresh = runpy.run_path(str(WORKFLOW))["build"]("imagegen_recompute", reuse_pages=False)
    async with Client(nodes.addresses["coordinator"]) as client:
        await client.register(fresh)
        result = await client.run("imagegen_recompute", {"prompt": "a tram at noon", **SIZE})
    assert result.ok, result.error
    _check_image(result.outputs["image"], 32, 32)
    out = result.outputs
    # At most the chat template's leading pages (the same in every prompt) were cached.
    assert out["cached_prompt_tokens"] < _full_pages(out["prompt_tokens"]), out
    started = {e.node_started.node for e in result.events if e.HasField("node_started")}
    assert "prefill" not in started and "draw" in started


def test_imagegen_through_the_cli(nodes: Nodes, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "omniflow.cli.main"]
    env = {**os.environ, "OMNIFLOW_COORDINATOR_ADDR": nodes.addresses["coordinator"]}
    coord = ["--coordinator", nodes.addresses["coordinator"]]
    reg = subprocess.run(
        [*cli, "workflow", "register", str(WORKFLOW), *coord],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert reg.returncode == 0, reg.stderr
    run = subprocess.run(
        [*cli, "run", "imagegen", "--input", "prompt=a windmill on a hill", "--input", "width=32",
         "--input", "height=32", "--input", "steps=2", "--out-dir", str(tmp_path), *coord],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    png = Path(out["image"])
    assert png == tmp_path / "imagegen.image.png"
    _check_image(png.read_bytes(), 32, 32)
    assert out["cached_prompt_tokens"] == _full_pages(out["prompt_tokens"]) > 0, out
    # Progress names the workers: the draw ran on the prefill's node.
    lines = [ln.strip() for ln in run.stderr.splitlines()]
    started = [ln.split() for ln in lines if ln.startswith("> ") and " on " in ln]
    on = {words[1]: words[3] for words in started}
    assert nodes.node_of[on["prefill"]] == nodes.node_of[on["draw"]], run.stderr


def test_the_graph_is_what_the_docs_say() -> None:
    graph = runpy.run_path(str(WORKFLOW))["imagegen"].compile()
    assert [p.name for p in graph.inputs] == ["prompt", "width", "height", "steps", "seed"]
    assert [p.name for p in graph.inputs if not p.optional] == ["prompt"]
    assert set(graph.outputs) == {
        "image", "prompt_used", "width", "height", "prompt_tokens", "cached_prompt_tokens"
    }  # fmt: skip
    nodes = {n.name: n for n in graph.nodes}
    assert nodes["prefill"].params["prefill_only"].bool_value
    assert nodes["draw"].call.strategy == router_pb2.STRATEGY_KV_AWARE
    assert set(nodes["draw"].inputs) == {"pages", "width", "height", "steps", "seed"}
