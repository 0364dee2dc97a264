"""encoder.transcribe is an operation graphs can call (the coordinator sends it through
Invoke, as it does every operation without a method of its own)."""

from __future__ import annotations

import pytest

from omniflow.dsl import VType, Workflow
from omniflow.dsl.ops import signature
from omniflow.dsl.validate import validate_graph
from omniflow.errors import InvalidArgument


def test_transcribe_signature_and_graph() -> None:
    sig = signature("encoder", "transcribe")
    assert set(sig.input_types) - sig.optional == {"audio"} and sig.outputs["text"] == VType.TEXT
    # OpenAI's transcription fields are optional inputs; timed segments an output.
    assert sig.optional == {"prompt", "temperature", "language", "task", "timestamps", "seed"}
    assert sig.outputs["segments"] == VType.LIST
    wf = Workflow("hear")
    audio = wf.input("audio", VType.BYTES)
    heard = wf.call("asr", "encoder", "transcribe", audio=audio)
    wf.output("text", heard["text"])
    graph = wf.compile()
    validate_graph(graph)
    (node,) = graph.nodes
    assert (node.call.role, node.call.operation) == ("encoder", "transcribe")
    other = Workflow("bad")
    bad = other.call("asr", "encoder", "transcribe", audio=other.input("audio", VType.BYTES))
    with pytest.raises(InvalidArgument, match=r"node 'asr' has no output 'words'; outputs: .*text"):
        bad["words"]
