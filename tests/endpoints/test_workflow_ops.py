"""The operations behind the new routes are workflow operations too (one table of roles):
a graph calling ``embed.embed`` gets the vectors /v1/embeddings answers, and one calling
``encoder.transcribe`` with timestamps gets the segments verbose_json answers."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
from endpoints_topology import MINILM, WHISPER, Endpoints

from omniflow.client import Client
from omniflow.dsl import VType, Workflow

sys.path.insert(0, str(Path(__file__).parent.parent / "audio"))
from audio_clips import espeak

TEXTS = ["A man is eating food.", "Paged attention"]


def _run(endpoints: Endpoints, wf: Workflow, inputs: dict) -> dict:
    async def go() -> dict:
        async with Client(endpoints.procs["coordinator"].address) as c:
            await c.register(wf)
            result = await c.run(wf.name, inputs)
            assert result.state == "succeeded", result.error
            return result.outputs

    return asyncio.run(go())


def test_embed_node_equals_the_route(endpoints: Endpoints, client) -> None:
    wf = Workflow("ep-embed")
    node = wf.call("vec", "embed", "embed", texts=wf.input("texts", VType.LIST))
    wf.output("embeddings", node["embeddings"])
    wf.output("prompt_tokens", node["prompt_tokens"])
    out = _run(endpoints, wf, {"texts": TEXTS})
    got = np.frombuffer(out["embeddings"], dtype="<f4").reshape(len(TEXTS), -1)
    route = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    assert np.allclose(got, [d.embedding for d in route.data], atol=1e-6)
    assert out["prompt_tokens"] == route.usage.prompt_tokens


def test_transcribe_node_takes_the_options(endpoints: Endpoints, client) -> None:
    wav = espeak("Please send the report before Friday. Thank you very much.")
    wf = Workflow("ep-hear")
    node = wf.call(
        "asr",
        "encoder",
        "transcribe",
        audio=wf.input("audio", VType.BYTES),
        params={"timestamps": True},
    )
    wf.output("text", node["text"])
    wf.output("segments", node["segments"])
    out = _run(endpoints, wf, {"audio": wav})
    verbose = client.audio.transcriptions.create(
        file=("c.wav", wav), model=WHISPER, response_format="verbose_json"
    )
    assert out["text"] == verbose.text
    assert [(s["start"], s["end"], s["text"]) for s in out["segments"]] == [
        (s.start, s.end, s.text) for s in verbose.segments
    ]
