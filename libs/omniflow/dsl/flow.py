"""Where a graph's values go: the call inputs each graph input reaches (and so the chat parts
it takes), and what each graph output carries (and so the part of an answer it gives).

A graph input reaches a call input when the call reads it directly, or through the bodies
of switch, loop and map nodes (a body input is the node input of the same name; not a
map's items, which are not the list itself), or through an output a body passes on
unchanged (``{"transcript": g.input("text")}``) and a later call reads. Conditions read
values but take none. The chat part of a call input is its ``chat`` in the table of
operations (``omniflow.operations``): the gateway gives a chat's text to the workflow input
that reaches, say, ``llm.generate``'s ``prompt``.

A graph output carries the call outputs it may hold, followed the same way through switch
and loop bodies (a map's outputs are lists, which carry none of their items' parts). The
answer part of a call output is its ``answers`` in the table: ``llm.generate``'s ``text``
is the reply's text, ``talker.synthesize``'s ``wav`` the spoken reply. An output of an
operation outside the table carries ``text`` when the graph declares it TEXT.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.operations import operation
from omniflow.values import VType

#: (role, operation, input) of a call input.
CallInput = tuple[str, str, str]
# A value a graph holds: ("input", graph input) or ("call", call path, role, operation,
# output); a call's path names the bodies it is in, so that two bodies' calls differ.
_Value = tuple[str, ...]
# (call path, role, operation, input) -> the values it may read.
_Feeds = dict[tuple[str, str, str, str], set[_Value]]


@dataclass(frozen=True, slots=True)
class OutputFlow:
    """What one graph output carries: the answer ``parts`` (``operations.ANSWER_PARTS``) of
    the call outputs it may hold; the ``calls`` (paths) those come from; the other graph
    outputs that calls reading it give (``feeds``: ``draft`` feeds ``answer`` when a call
    rewrites the draft into the answer); ``drawn``: it holds the prompt an image operation
    draws (read by it, or by the call whose pages it draws)."""

    parts: frozenset[str]
    calls: frozenset[str]
    feeds: frozenset[str]
    drawn: bool


def _origins(
    src: cpb.Source, inputs: Mapping[str, set[_Value]], carried: dict, calls: dict
) -> set[_Value]:
    kind = src.WhichOneof("kind")
    if kind == "graph_input":
        return set(inputs.get(src.graph_input, ()))
    if kind == "node_output":
        ref = src.node_output
        if ref.node in calls:
            return {("call", *calls[ref.node], ref.output)}
        return set(carried.get((ref.node, ref.output), ()))
    return set()


def _walk(
    nodes: list[cpb.Node],
    outputs: Mapping[str, cpb.Source],
    inputs: Mapping[str, set[_Value]],
    feeds: _Feeds,
    prefix: str = "",
) -> dict[str, set[_Value]]:
    """Record in ``feeds`` the values each call input may read (``inputs``: each body
    input -> the values it holds); answer the values each of ``outputs`` may hold."""
    carried: dict[tuple[str, str], set[_Value]] = {}
    calls: dict[str, tuple[str, str, str]] = {}
    for node in nodes:  # declaration order: a node reads only earlier ones
        given = {k: _origins(s, inputs, carried, calls) for k, s in node.inputs.items()}
        kind = node.WhichOneof("kind")
        path = prefix + node.name
        if kind == "call":
            role, op = node.call.role, node.call.operation
            for key, origins in given.items():
                feeds.setdefault((path, role, op, key), set()).update(origins)
            calls[node.name] = (path, role, op)
            continue
        if kind == "switch":
            bodies = [c.body for c in node.switch.cases] + [node.switch.default_body]
        elif kind == "loop":
            bodies = [node.loop.body]
        elif kind == "map":
            bodies = [node.map.body]
        else:
            continue
        if kind == "map":  # the body gets the list's items, not the list an input holds
            given[node.map.over] = set()
        for i, body in enumerate(bodies):
            inner = f"{path}/{i}/"
            body_in = dict(given)
            passed = _walk(list(body.nodes), body.outputs, body_in, feeds, inner)
            if kind == "loop":  # an output named like an input feeds the next round
                body_in = {k: v | passed.get(k, set()) for k, v in given.items()}
                passed = _walk(list(body.nodes), body.outputs, body_in, feeds, inner)
            for out, origins in passed.items():
                if kind == "map":  # a list of the body's values: none of their parts
                    origins = {v for v in origins if v[0] == "input"}
                carried.setdefault((node.name, out), set()).update(origins)
    return {k: _origins(s, inputs, carried, calls) for k, s in outputs.items()}


def _flow(graph: cpb.WorkflowGraph) -> tuple[_Feeds, dict[str, set[_Value]]]:
    feeds: _Feeds = {}
    given = {p.name: {("input", p.name)} for p in graph.inputs}
    held = _walk(list(graph.nodes), graph.outputs, given, feeds)
    return feeds, held


def input_reach(graph: cpb.WorkflowGraph) -> dict[str, set[CallInput]]:
    """Each input of ``graph`` -> the call inputs it reaches."""
    reach: dict[str, set[CallInput]] = {p.name: set() for p in graph.inputs}
    feeds, _ = _flow(graph)
    for (_, role, op, key), values in feeds.items():
        for value in values:
            if value[0] == "input":
                reach[value[1]].add((role, op, key))
    return reach


def chat_parts(graph: cpb.WorkflowGraph) -> dict[str, frozenset[str]]:
    """Each input of ``graph`` -> the chat parts (``operations.CHAT_PARTS``) the call inputs
    it reaches take; empty for an input that reaches none (or only user operations)."""
    out: dict[str, frozenset[str]] = {}
    for name, calls in input_reach(graph).items():
        out[name] = frozenset(filter(None, (_chat_of(*call) for call in calls)))
    return out


def _part(value: _Value, declared: int) -> str:
    """The answer part of a call output ("" for none)."""
    if value[0] != "call":
        return ""
    _, _, role, op_name, output = value
    op = operation(role, op_name)
    if op is None:  # a user operation: the graph's declared kind says
        return "text" if declared == VType.TEXT else ""
    return op.answers.get(output, "")


def output_flow(graph: cpb.WorkflowGraph) -> dict[str, OutputFlow]:
    """Each output of ``graph`` -> what it carries (:class:`OutputFlow`)."""
    feeds, held = _flow(graph)
    declared = {p.name: int(p.type) for p in graph.output_ports}
    calls = {o: {v[1] for v in values if v[0] == "call"} for o, values in held.items()}
    # Calls whose text prompt an image operation draws: the image call, and a call whose
    # output it reads by another input than its text (the pages of a prefill_only call).
    image_calls = {path for (path, r, o, _) in feeds if "image" in _answers_of(r, o)}
    drawing = set(image_calls)
    for (path, role, op_name, key), values in feeds.items():
        if path in image_calls and _chat_of(role, op_name, key) != "text":
            drawing |= {v[1] for v in values if v[0] == "call"}
    drawn_values: set[_Value] = set()
    for (path, role, op_name, key), values in feeds.items():
        if path in drawing and _chat_of(role, op_name, key) == "text":
            drawn_values |= values
    out: dict[str, OutputFlow] = {}
    for name, values in held.items():
        readers = {p for (p, _, _, _), vs in feeds.items() if vs & values}
        out[name] = OutputFlow(
            frozenset(filter(None, (_part(v, declared.get(name, 0)) for v in values))),
            frozenset(calls[name]),
            frozenset(o for o in held if o != name and calls[o] & readers),
            bool(values & drawn_values),
        )
    return out


def _chat_of(role: str, op_name: str, key: str) -> str:
    op = operation(role, op_name)
    port = op.input(key) if op is not None else None
    return port.chat if port is not None else ""


def _answers_of(role: str, op_name: str) -> frozenset[str]:
    op = operation(role, op_name)
    return frozenset(op.answers.values()) if op is not None else frozenset()
