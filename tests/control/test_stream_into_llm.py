"""A `.stream()` edge into an llm's prompt feeds it whole phrases: the consumer runs once per
phrase of the producer's text, never once per streamed token (the README's chain). Real
processes: router, coordinator and echo TEST workers (which stream their answer word by
word) on a private Redis."""

from __future__ import annotations

import asyncio

import pytest

from omniflow.client import Client
from omniflow.dsl import VType, Workflow
from omniflow.operations import PHRASE_INPUT_CHARS

pytestmark = pytest.mark.integration

QUESTION = "One two three. Four five six, seven eight nine ten eleven. Twelve thirteen."


def _chain() -> Workflow:
    wf = Workflow("stream-into-llm")
    draft = wf.call("draft", "llm", "generate", prompt=wf.input("q", VType.TEXT))
    polish = wf.call("polish", "llm", "generate", prompt=draft["text"].stream())
    wf.output("draft", draft["text"])
    wf.output("answer", polish["text"])
    return wf


def test_a_plain_stream_into_a_prompt_is_phrased() -> None:
    graph = _chain().compile()
    src = next(n for n in graph.nodes if n.name == "polish").inputs["prompt"]
    assert src.streaming and src.phrase_chars == PHRASE_INPUT_CHARS


def test_stream_into_llm_runs_once_per_phrase(cluster) -> None:
    procs = cluster({"llm": 1})

    async def go():
        async with Client(procs["coordinator"].address) as client:
            await client.register(_chain())
            return await client.run("stream-into-llm", {"q": QUESTION})

    result = asyncio.run(go())
    assert result.ok, result.error
    draft = result.outputs["draft"]
    assert draft == f"echo: {QUESTION}"  # streamed as 14 word chunks
    starts = [e.node_started for e in result.events if e.HasField("node_started")]
    polish_calls = [s for s in starts if s.node == "polish"]
    # Phrases, not tokens: the first short phrase, then sentences and long clauses.
    assert 2 <= len(polish_calls) <= 4 < len(draft.split()), polish_calls
    # Each call echoed its phrase; the answers, joined with a space, hold the draft whole.
    answer = result.outputs["answer"]
    assert answer.count("echo: ") == len(polish_calls) + 1, answer
    # (each call's own "echo:", plus the draft's in its first phrase)
    assert [w for w in answer.split() if w != "echo:"] == QUESTION.split(), answer


def test_cli_progress_shows_streamed_text_by_sentence_not_by_token() -> None:
    import io

    from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
    from omniflow.cli.workflow import Progress
    from omniflow.values import from_python

    out = io.StringIO()
    progress = Progress(out, quiet=False)
    words = ("A KV cache keeps keys. It holds values of past tokens, so the model does not "
             "recompute them at every step of decoding").split(" ")  # fmt: skip
    for i, word in enumerate(words):  # two nodes streaming at once, one word per chunk
        for node in ("draft", "polish"):
            chunk = from_python(word if i == 0 else " " + word)
            ev = cpb.NodeOutputChunk(node=node, output="text", chunk=chunk)
            progress(cpb.RunEvent(node_output=ev))
    for node in ("draft", "polish"):
        done = cpb.NodeFinished(node=node, state=cpb.RUN_STATE_SUCCEEDED, duration_ms=1.0)
        progress(cpb.RunEvent(node_finished=done))
    lines = out.getvalue().splitlines()
    polish = [ln for ln in lines if ln.startswith("  ~ polish.text: ")]
    assert len(polish) == 3 < len(words), lines  # a sentence, a long line, the rest
    assert polish[0] == "  ~ polish.text: A KV cache keeps keys.", polish
    text = " ".join(ln.removeprefix("  ~ polish.text: ") for ln in polish)
    assert text.split() == words
    assert lines[-1] == "  ok polish (1.0 ms)"
