"""A `.stream()` edge into an llm's prompt feeds it whole phrases: the consumer runs once per
phrase of the producer's text, never once per streamed token (the README's chain). Real
processes: router, coordinator and echo TEST workers (which stream their answer word by
word) on a private Redis."""

from __future__ import annotations

import asyncio

import pytest

from omniflow.client import Client
from omniflow.dsl import VType, Workflow
from omniflow.dsl.ops import PHRASE_INPUT_CHARS

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
