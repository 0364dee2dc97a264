"""Where a graph's inputs go: the call inputs each one reaches, and so the chat parts it
takes.

A graph input reaches a call input when the call reads it directly, or through the bodies
of switch, loop and map nodes (a body input is the node input of the same name; not a
map's items, which are not the list itself), or through an output a body passes on
unchanged (``{"transcript": g.input("text")}``) and a later call reads. Conditions read
values but take none. The chat part of a call input is
its ``chat`` in the table of operations (``omniflow.operations``): the gateway gives a
chat's text to the workflow input that reaches, say, ``llm.generate``'s ``prompt``.
"""

from __future__ import annotations

from collections.abc import Mapping

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.operations import operation

#: (role, operation, input) of a call input.
CallInput = tuple[str, str, str]


def _origins(src: cpb.Source, inputs: Mapping[str, set[str]], carried: dict) -> set[str]:
    kind = src.WhichOneof("kind")
    if kind == "graph_input":
        return set(inputs.get(src.graph_input, ()))
    if kind == "node_output":
        return set(carried.get((src.node_output.node, src.node_output.output), ()))
    return set()


def _walk(
    nodes: list[cpb.Node],
    outputs: Mapping[str, cpb.Source],
    inputs: Mapping[str, set[str]],
    reach: dict[str, set[CallInput]],
) -> dict[str, set[str]]:
    """Record in ``reach`` the call inputs the graph inputs (``inputs``: each body input ->
    the top-level inputs it carries) get to; answer the top-level inputs each output
    carries unchanged."""
    carried: dict[tuple[str, str], set[str]] = {}
    for node in nodes:  # declaration order: a node reads only earlier ones
        given = {k: _origins(s, inputs, carried) for k, s in node.inputs.items()}
        kind = node.WhichOneof("kind")
        if kind == "call":
            for key, origins in given.items():
                for origin in origins:
                    reach[origin].add((node.call.role, node.call.operation, key))
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
        for body in bodies:
            body_in = dict(given)
            passed = _walk(list(body.nodes), body.outputs, body_in, reach)
            if kind == "loop":  # an output named like an input feeds the next round
                body_in = {k: v | passed.get(k, set()) for k, v in given.items()}
                passed = _walk(list(body.nodes), body.outputs, body_in, reach)
            for out, origins in passed.items():
                carried.setdefault((node.name, out), set()).update(origins)
    return {k: _origins(s, inputs, carried) for k, s in outputs.items()}


def input_reach(graph: cpb.WorkflowGraph) -> dict[str, set[CallInput]]:
    """Each input of ``graph`` -> the call inputs it reaches."""
    reach: dict[str, set[CallInput]] = {p.name: set() for p in graph.inputs}
    _walk(list(graph.nodes), graph.outputs, {p.name: {p.name} for p in graph.inputs}, reach)
    return reach


def chat_parts(graph: cpb.WorkflowGraph) -> dict[str, frozenset[str]]:
    """Each input of ``graph`` -> the chat parts (``operations.CHAT_PARTS``) the call inputs
    it reaches take; empty for an input that reaches none (or only user operations)."""
    out: dict[str, frozenset[str]] = {}
    for name, calls in input_reach(graph).items():
        parts = set()
        for role, op_name, key in calls:
            op = operation(role, op_name)
            port = op.input(key) if op is not None else None
            if port is not None and port.chat:
                parts.add(port.chat)
        out[name] = frozenset(parts)
    return out
