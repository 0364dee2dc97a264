"""Static checks of a WorkflowGraph, shared by the DSL and the coordinator.

Every error names the node (as a path for nested ones: ``refine/body/draft``) and says
what is accepted: unknown role or operation, an input with no source, a reference to a
missing node or output, a type mismatch, or a cycle outside a loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.errors import InvalidArgument
from omniflow.operations import OPERATIONS, ROLES, operation
from omniflow.values import VType, compatible, to_python, type_of

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
MAX_RETRY_ATTEMPTS = 10
MAX_LOOP_ITERATIONS = 10_000
LOOP_ITERATION_INPUT = "iteration"


def _fail(path: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"node {path!r}: {message}" if path else message)


class _Scope:
    """Inputs and nodes visible to the nodes of one (sub)graph."""

    def __init__(self, inputs: Iterable[cpb.Port], nodes: Iterable[cpb.Node], prefix: str) -> None:
        self.inputs = {p.name: VType(p.type) for p in inputs}
        self.nodes = {n.name: n for n in nodes}
        self.prefix = prefix

    def path(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def source_type(self, src: cpb.Source, where: str) -> VType:
        kind = src.WhichOneof("kind")
        if kind == "graph_input":
            if src.graph_input not in self.inputs:
                raise _fail(
                    where,
                    f"reads input {src.graph_input!r}, which is not an input of its graph; "
                    f"inputs: {', '.join(sorted(self.inputs)) or 'none'}",
                )
            if src.streaming:
                raise _fail(where, "only a node output can be streamed")
            return self.inputs[src.graph_input]
        if kind == "node_output":
            ref = src.node_output
            node = self.nodes.get(ref.node)
            if node is None:
                raise _fail(where, f"reads from node {ref.node!r}, which is not in the same graph")
            ports = {p.name: VType(p.type) for p in node.outputs}
            if ref.output not in ports:
                raise _fail(
                    where,
                    f"reads output {ref.output!r} of {ref.node!r}; its outputs: "
                    f"{', '.join(sorted(ports)) or 'none'}",
                )
            if src.streaming and node.WhichOneof("kind") != "call":
                raise _fail(where, f"streams from {ref.node!r}, which is not a call node")
            return ports[ref.output]
        if kind == "constant":
            return type_of(to_python(src.constant))
        raise _fail(where, "an input has no source (unconnected)")


def _deps(node: cpb.Node) -> set[str]:
    found = {s.node_output.node for s in node.inputs.values() if s.HasField("node_output")}
    if node.HasField("switch"):
        for case in node.switch.cases:
            if case.when.value.HasField("node_output"):
                found.add(case.when.value.node_output.node)
    return found


def _check_acyclic(nodes: Iterable[cpb.Node], scope: _Scope) -> list[str]:
    """Topological order of the nodes; raises naming a cycle."""
    deps = {n.name: _deps(n) for n in nodes}
    order: list[str] = []
    state: dict[str, int] = {}  # 1: visiting, 2: done

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = [*trail[trail.index(name) :], name]
            raise _fail(
                scope.path(name),
                f"cycle {' -> '.join(cycle)}; repeat work with a loop node instead",
            )
        state[name] = 1
        for dep in sorted(deps[name]):
            if dep in deps:
                visit(dep, [*trail, name])
        state[name] = 2
        order.append(name)

    for name in deps:
        visit(name, [])
    return order


def _check_predicate(pred: cpb.Predicate, scope: _Scope, where: str) -> None:
    if pred.op == cpb.Predicate.OP_UNSPECIFIED:
        raise _fail(where, "a condition has no operator")
    if pred.op == cpb.Predicate.OP_PRESENT:
        if not pred.value.HasField("graph_input") and not pred.value.HasField("node_output"):
            raise _fail(where, "present() needs an input or a node output")
        return
    scope.source_type(pred.value, where)


def _check_subgraph(sub: cpb.Subgraph, node_inputs: set[str], path: str, extra: set[str]) -> None:
    for port in sub.inputs:
        if port.name not in node_inputs and port.name not in extra:
            raise _fail(path, f"body input {port.name!r} is not an input of the node")
    _check_nodes(sub.inputs, sub.nodes, sub.outputs, f"{path}/")


def _check_node(node: cpb.Node, scope: _Scope) -> None:
    path = scope.path(node.name)
    kind = node.WhichOneof("kind")
    if kind is None:
        raise _fail(path, "has no kind; accepted: call, switch, loop, map")
    if node.retry.max_attempts > MAX_RETRY_ATTEMPTS:
        raise _fail(path, f"retry max_attempts must be at most {MAX_RETRY_ATTEMPTS}")
    types = {k: scope.source_type(s, path) for k, s in node.inputs.items()}
    for port in node.input_ports:
        if port.name not in types:
            if not port.optional:
                raise _fail(path, f"input {port.name!r} is not connected")
            continue
        if not compatible(types[port.name], VType(port.type)):
            raise _fail(
                path,
                f"input {port.name!r} expects {VType(port.type).name.lower()}, "
                f"gets {types[port.name].name.lower()}",
            )
    if kind == "call":
        role, op = node.call.role, node.call.operation
        if not role or not op:
            raise _fail(path, "a call needs a role and an operation")
        if role in ROLES and operation(role, op) is None:
            ops = sorted(o.name for o in OPERATIONS if o.role == role)
            raise _fail(path, f"role {role!r} has no operation {op!r}; accepted: {', '.join(ops)}")
        key = node.call.session_key_input
        if key and key not in node.inputs:
            raise _fail(path, f"session key input {key!r} is not an input of the node")
        return
    inputs = set(node.inputs)
    outputs = {p.name for p in node.outputs}
    if kind == "switch":
        bodies = [(c.name or f"case{i}", c.body) for i, c in enumerate(node.switch.cases)]
        bodies.append(("default", node.switch.default_body))
        for i, case in enumerate(node.switch.cases):
            _check_predicate(case.when, scope, path)
            if not case.name:
                raise _fail(path, f"case {i} has no name")
        for case_name, body in bodies:
            _check_subgraph(body, inputs, f"{path}/{case_name}", set())
            missing = outputs - set(body.outputs)
            if missing:
                raise _fail(
                    f"{path}/{case_name}",
                    f"body does not produce the switch outputs {', '.join(sorted(missing))}",
                )
    elif kind == "loop":
        spec = node.loop
        if not 1 <= spec.max_iterations <= MAX_LOOP_ITERATIONS:
            raise _fail(path, f"max_iterations must be 1..{MAX_LOOP_ITERATIONS}")
        _check_subgraph(spec.body, inputs, f"{path}/body", {LOOP_ITERATION_INPUT})
        body_outs = set(spec.body.outputs)
        for out in outputs - body_outs:
            raise _fail(path, f"output {out!r} is not an output of the loop body")
        if spec.until.op == cpb.Predicate.OP_UNSPECIFIED:
            raise _fail(path, "a loop needs an exit condition (until)")
        if spec.until.value.graph_input not in body_outs:
            raise _fail(
                path,
                "the exit condition must read a body output; outputs: "
                f"{', '.join(sorted(body_outs)) or 'none'}",
            )
    elif kind == "map":
        if node.map.over not in inputs:
            raise _fail(path, f"maps over {node.map.over!r}, which is not an input of the node")
        _check_subgraph(node.map.body, inputs, f"{path}/body", set())
        for out in outputs - set(node.map.body.outputs):
            raise _fail(path, f"output {out!r} is not an output of the map body")


def _check_nodes(
    inputs: Iterable[cpb.Port],
    nodes: Iterable[cpb.Node],
    outputs: dict[str, cpb.Source] | object,
    prefix: str,
) -> None:
    nodes = list(nodes)
    scope = _Scope(inputs, nodes, prefix)
    seen: set[str] = set()
    for node in nodes:
        if not _NAME.match(node.name):
            raise _fail(
                scope.path(node.name or "?"),
                "node names are 1-64 letters, digits, '_', '.', '-' starting with a letter",
            )
        if node.name in seen:
            raise _fail(scope.path(node.name), "two nodes have this name in one graph")
        seen.add(node.name)
    _check_acyclic(nodes, scope)
    for node in nodes:
        _check_node(node, scope)
    for key, src in outputs.items():  # type: ignore[attr-defined]
        scope.source_type(src, f"{prefix}output:{key}")


def validate_graph(graph: cpb.WorkflowGraph) -> None:
    """Raise InvalidArgument naming the node at fault, or return when the graph is sound."""
    if not _NAME.match(graph.name):
        raise InvalidArgument(
            f"workflow name {graph.name!r} is not accepted: 1-64 letters, digits, '_', '.', '-'"
        )
    if not graph.nodes:
        raise InvalidArgument(f"workflow {graph.name!r} has no nodes")
    if not graph.outputs:
        raise InvalidArgument(f"workflow {graph.name!r} has no outputs")
    _check_nodes(graph.inputs, graph.nodes, graph.outputs, "")
    scope = _Scope(graph.inputs, graph.nodes, "")
    for port in graph.output_ports:
        if port.name not in graph.outputs:
            raise InvalidArgument(f"output port {port.name!r} has no source")
        got = scope.source_type(graph.outputs[port.name], f"output:{port.name}")
        if not compatible(got, VType(port.type)):
            raise InvalidArgument(
                f"output {port.name!r} is declared {VType(port.type).name.lower()} "
                f"but gets {got.name.lower()}"
            )
