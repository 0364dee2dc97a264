"""The DSL: building, validation errors that name the node, rendering, file loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.dsl import Graph, Retry, VType, Workflow, register_operation, to_dot, to_mermaid
from omniflow.dsl.loader import load_workflows
from omniflow.dsl.validate import validate_graph
from omniflow.errors import InvalidArgument

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "workflows"

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})
register_operation("echo", "sleep", {"ms": VType.INT}, {"slept_ms": VType.FLOAT})


def _chain() -> Workflow:
    wf = Workflow("chain", description="two steps", deadline_ms=5000)
    q = wf.input("question", VType.TEXT)
    d = wf.call("draft", "llm", "generate", prompt=q, retry=Retry(3), timeout_ms=100)
    u = wf.call("up", "echo", "upper", text=d["text"].stream(), max_concurrency=2)
    wf.output("answer", u["text"])
    return wf


def test_compile_produces_the_graph_message():
    g = _chain().compile()
    assert g.name == "chain" and g.default_deadline_ms == 5000
    assert [n.name for n in g.nodes] == ["draft", "up"]
    draft, up = g.nodes
    assert (draft.call.role, draft.call.operation) == ("llm", "generate")
    assert draft.retry.max_attempts == 3 and draft.timeout_ms == 100
    assert draft.inputs["prompt"].graph_input == "question"
    src = up.inputs["text"]
    assert src.node_output.node == "draft" and src.node_output.output == "text" and src.streaming
    assert up.max_concurrency == 2
    assert g.outputs["answer"].node_output.node == "up"
    assert [p.name for p in g.output_ports] == ["answer"]


def test_unknown_role_and_operation_name_the_node():
    wf = Workflow("w")
    with pytest.raises(InvalidArgument, match=r"node 'x'.*unknown role 'nope'"):
        wf.call("x", "nope", "op")
    with pytest.raises(InvalidArgument, match=r"node 'y'.*unknown operation 'paint'.*llm.generate"):
        wf.call("y", "llm", "paint")


def test_unconnected_input_names_the_node():
    wf = Workflow("w")
    wf.call("gen", "llm", "generate")
    wf.output("o", wf.call("up", "echo", "upper", text="x")["text"])
    with pytest.raises(InvalidArgument, match=r"node 'gen': input 'prompt' is not connected"):
        wf.compile()


def test_type_mismatch_names_the_node_and_input():
    wf = Workflow("w")
    n = wf.input("n", VType.INT)
    wf.output("o", wf.call("gen", "llm", "generate", prompt=n)["text"])
    with pytest.raises(InvalidArgument, match=r"node 'gen': input 'prompt' expects text, gets int"):
        wf.compile()


def test_cycle_outside_a_loop_is_rejected():
    g = _chain().compile()
    g.nodes[0].inputs["prompt"].CopyFrom(
        cpb.Source(node_output=cpb.NodeOutput(node="up", output="text"))
    )
    with pytest.raises(InvalidArgument, match=r"cycle (draft -> up -> draft|up -> draft -> up)"):
        validate_graph(g)


def test_reference_to_a_missing_node_or_output():
    g = _chain().compile()
    g.nodes[1].inputs["text"].node_output.output = "txt"
    with pytest.raises(InvalidArgument, match=r"node 'up': reads output 'txt' of 'draft'"):
        validate_graph(g)
    g.nodes[1].inputs["text"].node_output.node = "ghost"
    with pytest.raises(InvalidArgument, match=r"node 'up': reads from node 'ghost'"):
        validate_graph(g)


def test_nested_errors_carry_the_path():
    wf = Workflow("w")
    t = wf.input("t", VType.TEXT)

    def body(g: Graph) -> dict:
        return {"t": g.call("inner", "llm", "generate", prompt=g.input("t"))["text"]}

    node = wf.loop("rounds", body=body, until=lambda o: o["t"].contains("x"), max_iterations=3, t=t)
    wf.output("o", node["t"])
    g = wf.compile()
    g.nodes[0].loop.body.nodes[0].inputs["prompt"].graph_input = "nope"
    with pytest.raises(InvalidArgument, match=r"node 'rounds/body/inner': reads input 'nope'"):
        validate_graph(g)
    g = wf.compile()
    g.nodes[0].loop.max_iterations = 0
    with pytest.raises(InvalidArgument, match=r"node 'rounds': max_iterations"):
        validate_graph(g)


def test_switch_bodies_must_produce_the_outputs():
    wf = Workflow("w")
    t = wf.input("t", VType.TEXT)
    match = r"node 's/a': body does not produce the switch outputs o"
    with pytest.raises(InvalidArgument, match=match):
        wf.switch(
            "s",
            cases=[("a", t.equals("a"), lambda g: {})],
            default=lambda g: {"o": g.input("t")},
            outputs={"o": VType.TEXT},
            t=t,
        )
        wf.output("o", t)
        wf.compile()


def test_streaming_from_a_graph_input_is_rejected():
    wf = Workflow("w")
    t = wf.input("t", VType.TEXT)
    with pytest.raises(InvalidArgument, match="only a node output can be streamed"):
        t.stream()


def test_rendering_names_every_node_and_marks_streaming_edges():
    g = _chain().compile()
    mermaid = to_mermaid(g)
    assert mermaid.startswith("%% chain\nflowchart TD")
    assert "draft<br/>llm.generate<br/>(retry 3, 100 ms)" in mermaid
    assert "-.->|text|" in mermaid  # the streaming edge is dotted
    dot = to_dot(g)
    assert dot.startswith('digraph "chain" {') and dot.rstrip().endswith("}")
    assert "style=dashed" in dot and 'label="up\\necho.upper' in dot


def test_examples_load_compile_and_render():
    names = set()
    for path in sorted(EXAMPLES.glob("*.py")):
        for wf in load_workflows(path):
            g = wf.compile()
            names.add(g.name)
            assert f"%% {g.name}" in to_mermaid(g)
    assert {"chain", "route", "refine", "fanout"} <= names


def test_loader_rejects_a_file_without_workflows(tmp_path):
    f = tmp_path / "empty.py"
    f.write_text("x = 1\n")
    with pytest.raises(InvalidArgument, match="defines no Workflow"):
        load_workflows(f)
