"""Mermaid and Graphviz drawings of graphs with constants at every depth: each edge joins
two drawn boxes, and a constant read inside a switch case, a loop body or a map body is
drawn inside that body's cluster."""

from __future__ import annotations

import re

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.dsl import Graph, VType, Workflow, register_operation, to_dot, to_mermaid

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})

_MERMAID_BOX = re.compile(r"^\s*(n\d+)(?:\[|\(\[|\{)\"(.*)\"(?:\]|\]\)|\})$")
_MERMAID_EDGE = re.compile(r"^\s*(n\d+) -(?:->|\.->)(?:\|[^|]*\|)? (n\d+)$")
_DOT_BOX = re.compile(r'^\s*(n\d+) \[label="(.*)", shape=\w+\];$')
_DOT_EDGE = re.compile(r"^\s*(n\d+) -> (n\d+)(?: \[.*\])?;$")


def _nested() -> cpb.WorkflowGraph:
    wf = Workflow("nested")
    text = wf.input("text", VType.TEXT)
    top = wf.call("top", "echo", "upper", text="top-const")

    def shout(g: Graph) -> dict:
        return {"out": g.call("shout", "echo", "upper", text="case-const")["text"]}

    def quiet(g: Graph) -> dict:
        return {"out": g.call("quiet", "echo", "upper", text="default-const")["text"]}

    sw = wf.switch(
        "pick",
        cases=[("loud", top["text"].equals("TOP-CONST"), shout)],
        default=quiet,
        outputs={"out": VType.TEXT},
        text=text,
    )

    def again(g: Graph) -> dict:
        return {"text": g.call("again", "echo", "upper", text="loop-const")["text"]}

    loop = wf.loop(
        "rounds",
        body=again,
        until=lambda o: o["text"].present(),
        max_iterations=2,
        text=sw["out"],
    )

    def each(g: Graph) -> dict:
        return {"r": g.call("each", "echo", "upper", text="map-const")["text"]}

    mapped = wf.map("all", over=wf.input("items", VType.LIST), body=each)
    wf.output("a", loop["text"])
    wf.output("b", mapped["r"])
    return wf.compile()


CONSTANTS = ("top-const", "case-const", "default-const", "loop-const", "map-const")


def _check(lines: list[str], box: re.Pattern[str], edge: re.Pattern[str]) -> dict[str, str]:
    """Box id -> label; fails on an edge from or to an id with no box."""
    boxes = {m.group(1): m.group(2) for m in map(box.match, lines) if m}
    edges = [m.groups() for m in map(edge.match, lines) if m]
    assert edges, "no edges parsed"
    undrawn = sorted({n for pair in edges for n in pair} - set(boxes))
    assert not undrawn, f"edges to or from nodes with no box: {undrawn}\n" + "\n".join(lines)
    return boxes


def _cluster_of(lines: list[str], index: int, opener: str, closer: str) -> str:
    """The title line of the innermost cluster around ``lines[index]`` ("" at top level)."""
    stack: list[str] = []
    for line in lines[:index]:
        if line.strip().startswith(opener):
            stack.append(line.strip())
        elif line.strip() == closer:
            stack.pop()
    return stack[-1] if stack else ""


def test_mermaid_draws_a_box_for_every_constant_in_its_body() -> None:
    lines = to_mermaid(_nested()).splitlines()
    boxes = _check(lines, _MERMAID_BOX, _MERMAID_EDGE)
    labels = {label: nid for nid, label in boxes.items()}
    where = {}
    for const in CONSTANTS:
        assert f"'{const}'" in labels or const in labels, f"no box for {const}"
        nid = labels.get(f"'{const}'") or labels[const]
        index = next(i for i, line in enumerate(lines) if _MERMAID_BOX.match(line)
                     and _MERMAID_BOX.match(line).group(1) == nid)  # fmt: skip
        where[const] = _cluster_of(lines, index, "subgraph", "end")
    assert where["top-const"] == ""
    assert "loud: " in where["case-const"]
    assert where["default-const"].endswith('["default"]')
    assert "rounds body" in where["loop-const"]
    assert "all body (per item)" in where["map-const"]


def test_graphviz_draws_a_box_for_every_constant() -> None:
    dot = to_dot(_nested())
    lines = dot.splitlines()
    boxes = _check(lines, _DOT_BOX, _DOT_EDGE)
    for const in CONSTANTS:
        assert any(const in label for label in boxes.values()), f"no box for {const}"
    assert dot.count("subgraph cluster_") == 4  # case, default, loop body, map body
