"""The flagship pipelines as workflows: omni-modal dialogue (and the image pipeline, when
``bench/pipeline_image.py`` is there), on real processes and real models.

Omni chat (examples/workflows/omni_chat.py), one node: kv-index, kv-agent, router,
coordinator, two llm workers (SmolLM2-135M-Instruct), an encoder (Whisper tiny.en and the
generated vision encoder) and a talker (the Piper voice). Measured in the same run:

- first audio: the time from submitting a typed question to the talker's first PCM chunk,
  with the phrase-streamed edge into the talker (``omni_chat`` as shipped) against the
  same graph with a plain edge (the talker waits for the whole answer); the same prompts,
  interleaved, greedy, so both speak the same answer; at the workflow's answer length,
  with longer answers (``--long-tokens``) and with questions asking for a detailed answer
  under a system prompt that allows one (``--detail-tokens``), where waiting costs more;
- turn latency: a spoken question (espeak-ng) through ``omni_chat`` to the whole spoken
  answer, and an image + question through ``omni_chat_e2e`` (turn 1, then turn 2 with the
  history: its cached prompt tokens).

Rows: workload, metric, value, baseline, ratio (value / baseline).

    python bench/pipelines.py                  # 4 prompts per variant, then the image bench
    python bench/pipelines.py --runs 2 --image-runs 2
    python bench/pipelines.py --skip-image
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.client import Client, RunResult
from omniflow.models.resolve import resolve_model
from omniflow.testing.nodes import WorkerSpec, start_nodes

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "examples" / "workflows" / "omni_chat.py"
DEFAULT_MODELS = "~/.cache/omniflow/models"
MODELS = ("smollm2-135m-instruct", "smollm2-135m-vision-encoder", "whisper-tiny.en", "piper-joe")
QUESTIONS = (
    "Tell me about cats, and why people love them.",
    "Explain how a bicycle works, in simple words.",
    "What should I pack for a trip to the mountains?",
    "Why is the sky blue? Explain it to a child.",
    "How do I make a good cup of tea?",
    "What are the benefits of walking every day?",
)
DETAILED = (
    "Explain in detail how the internet works, step by step.",
    "Explain in detail how plants make food from sunlight.",
    "Explain in detail how a car engine works.",
    "Explain in detail why we have seasons on Earth.",
)
DETAIL_SYSTEM = "You are a helpful voice assistant. Explain things fully, in detail."
SPOKEN = "What is the capital of France?"


def _models_dir() -> Path:
    return Path(os.environ.get("OMNIFLOW_MODELS_DIR", DEFAULT_MODELS)).expanduser()


def _topology() -> dict[str, list[WorkerSpec]]:
    return {
        "bench-node": [
            WorkerSpec("llm-1", "llm", MODELS[0]),
            WorkerSpec("llm-2", "llm", MODELS[0]),
            WorkerSpec("encoder-1", "encoder", f"{MODELS[1]},{MODELS[2]}"),
            WorkerSpec("talker-1", "talker", MODELS[3]),
        ]
    }


def variant(
    graph: cpb.WorkflowGraph,
    name: str,
    *,
    wait: bool = False,
    max_tokens: int = 0,
    system: str = "",
) -> cpb.WorkflowGraph:
    """``graph`` renamed; ``wait``: the talker's edge made plain (it speaks once the answer
    is whole); ``max_tokens``: the answer's length limit changed; ``system``: the system
    prompt changed."""
    out = cpb.WorkflowGraph()
    out.CopyFrom(graph)
    out.name = name
    if wait:
        speak = next(n for n in out.nodes if n.name == "speak")
        speak.inputs["text"].streaming = False
        speak.inputs["text"].phrase_chars = 0
    if max_tokens:
        answer = next(n for n in out.nodes if n.name == "answer")
        answer.params["max_tokens"].int_value = max_tokens
    if system:
        answer = next(n for n in out.nodes if n.name == "answer")
        answer.params["system"].text = system
    return out


def _png(size: int = 64) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (size, size))
    img.putdata(
        [(x * 4 % 256, y * 4 % 256, (x + y) * 2 % 256) for y in range(size) for x in range(size)]
    )
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _espeak(text: str) -> bytes:
    binary = shutil.which("espeak-ng")
    if binary is None:
        raise SystemExit("needs espeak-ng (apt-get install espeak-ng) to speak the question")
    return subprocess.run([binary, "--stdout", text], capture_output=True, check=True).stdout


async def _timed(client: Client, workflow: str, inputs: dict[str, Any]) -> tuple[RunResult, dict]:
    """The run and its times (ms): ``wall`` from submit to the end, ``first`` to its first
    PCM chunk, ``text`` to the answer's first text, ``llm`` the answer's call, ``talker``
    the talker's calls summed, ``calls`` how many talker calls there were."""
    started = time.perf_counter()
    t: dict[str, float] = {"llm": 0.0, "talker": 0.0, "calls": 0.0}

    def on(ev: cpb.RunEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind == "node_output":
            out, now = ev.node_output, (time.perf_counter() - started) * 1e3
            if out.node == "speak" and out.output == "pcm":
                t.setdefault("first", now)
            elif out.node == "answer" and out.output == "text":
                t.setdefault("text", now)
        elif kind == "node_finished" and ev.node_finished.node in ("answer", "speak"):
            if ev.node_finished.node == "answer":
                t["llm"] += ev.node_finished.duration_ms
            else:
                t["talker"] += ev.node_finished.duration_ms
                t["calls"] += 1

    result = await client.run(workflow, inputs, on_event=on)
    if not result.ok:
        raise RuntimeError(f"{workflow} failed: {result.error}")
    t["wall"] = (time.perf_counter() - started) * 1e3
    t.setdefault("first", t["wall"])
    t.setdefault("text", t["wall"])
    t["tokens"] = float(result.outputs.get("completion_tokens") or 0)
    return result, t


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _row(workload: str, metric: str, value: float, baseline: float | None, fmt: str) -> list[str]:
    if baseline is None or not baseline:
        return [workload, metric, format(value, fmt), "-", "-"]
    return [workload, metric, format(value, fmt), format(baseline, fmt), f"{value / baseline:.2f}"]


async def measure_chat(args: Any) -> list[list[str]]:
    """The omni chat rows. Reads from ``args``, each optional: ``runs`` (prompts per
    variant, default 4), ``long_tokens`` (max_tokens of the long answers, default 128),
    ``detail_tokens`` (max_tokens of the detailed answers, default 256; 0: none),
    ``detail_runs`` (prompts per detailed variant, at most ``runs``, default 2)."""
    runs = int(getattr(args, "runs", 4) or 4)
    long = int(getattr(args, "long_tokens", 128) or 128)
    detail = int(getattr(args, "detail_tokens", 256))
    detail_runs = int(getattr(args, "detail_runs", 2))
    models = _models_dir()
    for spec in MODELS:
        await asyncio.to_thread(resolve_model, spec, models)  # pulled once, before the workers
    found = runpy.run_path(str(WORKFLOWS))
    chat, e2e = found["omni_chat"].compile(), found["omni_chat_e2e"].compile()
    short = next(n for n in chat.nodes if n.name == "answer").params["max_tokens"].int_value
    typed = {
        "omni_chat": chat,
        "omni_chat_wait": variant(chat, "omni_chat_wait", wait=True),
        "omni_chat_long": variant(chat, "omni_chat_long", max_tokens=long),
        "omni_chat_long_wait": variant(chat, "omni_chat_long_wait", wait=True, max_tokens=long),
    }
    if detail:
        for name, wait in (("omni_chat_detail", False), ("omni_chat_detail_wait", True)):
            typed[name] = variant(chat, name, wait=wait, max_tokens=detail, system=DETAIL_SYSTEM)
    times: dict[str, dict[str, list[float]]] = {k: {} for k in typed}
    spoken: list[float] = []
    e2e1: list[float] = []
    e2e2: list[float] = []
    cached: list[float] = []
    prompt2: list[float] = []
    root = Path(tempfile.mkdtemp(prefix="omniflow-bench-chat-"))
    env = {"OMNIFLOW_WORKER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
           "OMNIFLOW_LOG_LEVEL": "WARNING"}  # fmt: skip
    nodes = await asyncio.to_thread(start_nodes, root, _topology(), models_dir=models, env=env)
    try:
        async with Client(nodes.addresses["coordinator"]) as client:
            for graph in (e2e, *typed.values()):
                await client.register(graph)
            question = _espeak(SPOKEN)
            image = _png()
            # Untimed: the first calls load tokenizers, warm the engines and the voice.
            await _timed(client, "omni_chat", {"audio": question})
            await _timed(client, "omni_chat_wait", {"text": QUESTIONS[-1]})
            await _timed(client, "omni_chat_e2e", {"image": _png(32), "text": "Hello?"})
            for i in range(runs):
                q = {"text": QUESTIONS[i % len(QUESTIONS)]}
                asks = {"text": DETAILED[i % len(DETAILED)]}
                names = list(typed) if i % 2 == 0 else list(reversed(typed))  # drift alike
                for name in names:
                    if "detail" in name and i >= detail_runs:
                        continue  # (long answers: fewer prompts keep the bench short)
                    _, t = await _timed(client, name, asks if "detail" in name else q)
                    for key, value in t.items():
                        times[name].setdefault(key, []).append(value)
                _, t = await _timed(client, "omni_chat", {"audio": question})
                spoken.append(t["wall"])
                ask = f"What is in this picture? ({i})"
                one, t1 = await _timed(client, "omni_chat_e2e", {"image": image, "text": ask})
                history = [
                    {"role": "user", "content": ask},
                    {"role": "assistant", "content": one.outputs["text"]},
                ]
                two, t2 = await _timed(
                    client,
                    "omni_chat_e2e",
                    {"image": image, "text": "Which colours?", "messages": history},
                )
                e2e1.append(t1["wall"])
                e2e2.append(t2["wall"])
                cached.append(float(two.outputs["cached_tokens"]))
                prompt2.append(float(two.outputs["prompt_tokens"]))
    finally:
        await asyncio.to_thread(nodes.stop)
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    loads = [(f"{short} tokens", "omni_chat"), (f"{long} tokens", "omni_chat_long")]
    if detail:
        loads.append((f"{detail} tokens, 'explain in detail'", "omni_chat_detail"))
    for label, name in loads:
        got, base = times[name], times[name + "_wait"]
        head, late = _med(got["first"]), _med(base["first"])
        work = f"omni_chat typed, max {label}"
        rows += [
            _row(work, "first audio ms (phrases vs whole answer)", head, late, ".0f"),
            _row(work, "first audio sooner x", late / head, None, ".1f"),
            _row(work, "first answer text ms (phrases vs whole answer)",
                 _med(got["text"]), _med(base["text"]), ".0f"),
            _row(work, "turn ms, all audio (phrases vs whole answer)",
                 _med(got["wall"]), _med(base["wall"]), ".0f"),
            _row(work, "llm call ms (phrases vs whole answer)",
                 _med(got["llm"]), _med(base["llm"]), ".0f"),
            _row(work, "talker ms, all calls (phrases vs whole answer)",
                 _med(got["talker"]), _med(base["talker"]), ".0f"),
            _row(work, "talker calls per answer", _med(got["calls"]), None, ".1f"),
            _row(work, "answer tokens (phrases vs whole answer)",
                 _med(got["tokens"]), _med(base["tokens"]), ".0f"),
        ]  # fmt: skip
    return [
        *rows,
        _row("omni_chat spoken", "turn ms (transcribe+llm+talker)", _med(spoken), None, ".0f"),
        _row("omni_chat_e2e image", "turn 2 ms (vs turn 1)", _med(e2e2), _med(e2e1), ".0f"),
        _row("omni_chat_e2e image", "turn 2 cached / prompt tokens", _med(cached),
             _med(prompt2), ".0f"),
    ]  # fmt: skip


async def measure(args: Any) -> list[list[str]]:
    """Every row: omni chat, then the image pipeline when its bench is installed."""
    rows = await measure_chat(args)
    for row in rows:  # kept on stderr too, should the image bench fail late
        print("  ".join(row), file=sys.stderr, flush=True)
    image = ROOT / "bench" / "pipeline_image.py"
    if not getattr(args, "skip_image", False) and image.is_file():
        spec = importlib.util.spec_from_file_location("pipeline_image", image)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        try:
            spec.loader.exec_module(module)
            rows += await module.measure(args)
        except Exception as exc:  # the chat rows still count: say why the image rows are not
            print(f"bench/pipeline_image.py failed: {exc!r}", file=sys.stderr)
            rows.append(["imagegen", "failed (see stderr)", "-", "-", "-"])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4, help="prompts per omni chat variant")
    p.add_argument("--long-tokens", type=int, default=128, help="max_tokens of long answers")
    p.add_argument(
        "--detail-tokens", type=int, default=256, help="max_tokens of detailed answers (0: none)"
    )
    p.add_argument("--detail-runs", type=int, default=2, help="prompts per detailed variant")
    p.add_argument("--skip-image", action="store_true", help="only the omni chat rows")
    p.add_argument("--image-runs", type=int, default=6, help="prompts per image variant")
    p.add_argument("--tiny", action="store_true", help="image bench: the tiny test models")
    p.add_argument("--image-size", type=int, default=64, help="image bench: pixels")
    p.add_argument("--image-steps", type=int, default=4, help="image bench: denoising steps")
    args = p.parse_args()
    started = time.monotonic()
    before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = asyncio.run(measure(args))
    header = ["workload", "metric", "value", "baseline", "ratio"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"wall {time.monotonic() - started:.0f} s; load average {before} at the start, "
        f"{load} at the end ({os.cpu_count()} cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
