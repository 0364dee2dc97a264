"""The typed builder: a workflow is a graph of nodes whose inputs are refs to values.

::

    wf = Workflow("chain", description="draft, then polish")
    question = wf.input("question", VType.TEXT)
    draft = wf.call("draft", "llm", "generate", prompt=question, params={"max_tokens": 64})
    wf.output("answer", draft["text"])
    graph = wf.compile()          # a validated coordinator.v1.WorkflowGraph

Bodies of ``switch``, ``loop`` and ``map`` are functions from a :class:`Graph` (whose
inputs are the node's inputs) to a dict of output refs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.convert import strategy_value
from omniflow.dsl.ops import signature
from omniflow.dsl.validate import validate_graph
from omniflow.errors import InvalidArgument
from omniflow.operations import PHRASE_INPUT_CHARS
from omniflow.values import VType, from_python, type_of

Body = Callable[["Graph"], Mapping[str, "Ref"]]


@dataclass(frozen=True, slots=True)
class Retry:
    """Per-node retry policy; a retried call goes to another worker."""

    max_attempts: int = 3
    initial_backoff_ms: int = 50
    backoff_multiplier: float = 2.0
    retry_on: tuple[str, ...] = ()  # status code names; empty: UNAVAILABLE, DEADLINE_EXCEEDED

    def to_proto(self) -> cpb.RetryPolicy:
        return cpb.RetryPolicy(
            max_attempts=self.max_attempts,
            initial_backoff_ms=self.initial_backoff_ms,
            backoff_multiplier=self.backoff_multiplier,
            retry_on=list(self.retry_on),
        )


class Ref:
    """A value in a graph: a graph input, a node output or a constant."""

    __slots__ = ("field_path", "graph", "source", "vtype")

    def __init__(
        self, graph: Graph | None, source: cpb.Source, vtype: VType, field_path: str = ""
    ) -> None:
        self.graph, self.source, self.vtype, self.field_path = graph, source, vtype, field_path

    def stream(self, phrase_chars: int = 0) -> Ref:
        """Consume this node output chunk by chunk: the consumer starts on the first one.

        ``phrase_chars`` > 0 (a text output): the consumer gets whole phrases instead, each
        up to a sentence or phrase boundary or at most that many characters (a talker
        speaks each phrase while the llm writes the next). An llm's ``prompt`` always
        gets phrases (at most ``operations.PHRASE_INPUT_CHARS`` when none is given): an llm
        called once per token would answer every word on its own."""
        if self.source.WhichOneof("kind") != "node_output":
            raise InvalidArgument("only a node output can be streamed")
        if phrase_chars < 0 or phrase_chars > 100_000:
            raise InvalidArgument(f"phrase_chars is {phrase_chars}; accepted: 0 to 100000")
        src = cpb.Source()
        src.CopyFrom(self.source)
        src.streaming = True
        src.phrase_chars = phrase_chars
        return Ref(self.graph, src, self.vtype, self.field_path)

    def field(self, path: str) -> Ref:
        """A field (dot path) of a struct value, for conditions."""
        return Ref(self.graph, self.source, VType.ANY, path)

    # -- conditions
    def _pred(self, op: int, operand: Any = None) -> cpb.Predicate:
        pred = cpb.Predicate(op=op, field=self.field_path)
        pred.value.CopyFrom(self.source)
        if operand is not None:
            pred.operand.CopyFrom(from_python(operand, "condition operand"))
        return pred

    def equals(self, v: Any) -> cpb.Predicate:
        return self._pred(cpb.Predicate.OP_EQUALS, v)

    def not_equals(self, v: Any) -> cpb.Predicate:
        return self._pred(cpb.Predicate.OP_NOT_EQUALS, v)

    def less(self, v: Any) -> cpb.Predicate:
        return self._pred(cpb.Predicate.OP_LESS, v)

    def greater(self, v: Any) -> cpb.Predicate:
        return self._pred(cpb.Predicate.OP_GREATER, v)

    def contains(self, v: Any) -> cpb.Predicate:
        return self._pred(cpb.Predicate.OP_CONTAINS, v)

    def truthy(self) -> cpb.Predicate:
        return self._pred(cpb.Predicate.OP_TRUTHY)

    def present(self) -> cpb.Predicate:
        return self._pred(cpb.Predicate.OP_PRESENT)


def const(value: Any) -> Ref:
    """A constant input value."""
    return Ref(None, cpb.Source(constant=from_python(value, "constant")), type_of(value))


class Node:
    """A node added to a graph; ``node["out"]`` is a ref to one of its outputs."""

    __slots__ = ("graph", "outputs", "proto")

    def __init__(self, graph: Graph, proto: cpb.Node, outputs: Mapping[str, VType]) -> None:
        self.graph, self.proto, self.outputs = graph, proto, dict(outputs)

    @property
    def name(self) -> str:
        return self.proto.name

    def __getitem__(self, output: str) -> Ref:
        if output not in self.outputs:
            raise InvalidArgument(
                f"node {self.name!r} has no output {output!r}; outputs: "
                f"{', '.join(sorted(self.outputs)) or 'none'}"
            )
        src = cpb.Source(node_output=cpb.NodeOutput(node=self.name, output=output))
        return Ref(self.graph, src, self.outputs[output])


def _ports(types: Mapping[str, VType], optional: frozenset[str] = frozenset()) -> list[cpb.Port]:
    return [cpb.Port(name=n, type=int(t), optional=n in optional) for n, t in types.items()]


def _as_ref(value: Any) -> Ref:
    return value if isinstance(value, Ref) else const(value)


class Graph:
    """A (sub)graph under construction: inputs, nodes and outputs."""

    def __init__(self, inputs: Mapping[str, VType] | None = None) -> None:
        self._inputs: dict[str, cpb.Port] = {}
        self._nodes: list[cpb.Node] = []
        self._names: set[str] = set()
        self._outputs: dict[str, tuple[Ref, VType]] = {}
        for name, vtype in (inputs or {}).items():
            self.input(name, vtype)

    # -- inputs and outputs
    def input(
        self, name: str, vtype: VType = VType.ANY, *, optional: bool = False, description: str = ""
    ) -> Ref:
        """Declare an input (or get one a body receives from its node)."""
        port = self._inputs.get(name)
        if port is None:
            port = cpb.Port(name=name, type=int(vtype), optional=optional, description=description)
            self._inputs[name] = port
        return Ref(self, cpb.Source(graph_input=name), VType(port.type))

    def output(self, name: str, ref: Ref, vtype: VType | None = None) -> None:
        self._outputs[name] = (ref, ref.vtype if vtype is None else vtype)

    # -- nodes
    def _add(
        self,
        name: str,
        inputs: Mapping[str, Any],
        *,
        retry: Retry | None,
        timeout_ms: int,
        max_concurrency: int,
        params: Mapping[str, Any] | None,
    ) -> cpb.Node:
        if name in self._names:
            raise InvalidArgument(f"node {name!r}: a node of this name exists in this graph")
        self._names.add(name)
        node = cpb.Node(name=name, timeout_ms=timeout_ms, max_concurrency=max_concurrency)
        for key, value in inputs.items():
            node.inputs[key].CopyFrom(_as_ref(value).source)
        for key, value in (params or {}).items():
            node.params[key].CopyFrom(from_python(value, f"node {name!r} param {key!r}"))
        if retry is not None:
            node.retry.CopyFrom(retry.to_proto())
        self._nodes.append(node)
        return node

    def call(
        self,
        name: str,
        role: str,
        operation: str,
        *,
        params: Mapping[str, Any] | None = None,
        retry: Retry | None = None,
        timeout_ms: int = 0,
        max_concurrency: int = 0,
        strategy: str = "",
        session_key: str = "",
        **inputs: Any,
    ) -> Node:
        """Call ``role.operation`` on a worker the router picks; keyword args are inputs.

        ``session_key`` names the input whose value routes consistent-hash calls.
        """
        try:
            sig = signature(role, operation)
        except InvalidArgument as exc:
            raise InvalidArgument(f"node {name!r}: {exc}") from None
        types = sig.input_types
        for key in inputs:
            if key not in types:
                raise InvalidArgument(
                    f"node {name!r}: {role}.{operation} has no input {key!r}; inputs: "
                    f"{', '.join(types)}"
                )
        node = self._add(
            name,
            inputs,
            retry=retry,
            timeout_ms=timeout_ms,
            max_concurrency=max_concurrency,
            params=params,
        )
        node.call.role, node.call.operation = role, operation
        node.call.session_key_input = session_key
        for key in sig.phrased & inputs.keys():
            src = node.inputs[key]
            if src.streaming and not src.phrase_chars:
                src.phrase_chars = PHRASE_INPUT_CHARS  # see operations.Input.phrased
        if strategy:
            node.call.strategy = strategy_value(strategy)
        return self._made(node, types, sig.outputs, sig.optional)

    def _control(
        self, name: str, inputs: Mapping[str, Any], retry: Retry | None, timeout_ms: int
    ) -> tuple[cpb.Node, dict[str, VType]]:
        """A switch, loop or map node (no params, no concurrency bound) and its input kinds."""
        refs = {k: _as_ref(v) for k, v in inputs.items()}
        node = self._add(
            name, refs, retry=retry, timeout_ms=timeout_ms, max_concurrency=0, params=None
        )
        return node, {k: r.vtype for k, r in refs.items()}

    def _made(
        self,
        node: cpb.Node,
        inputs: Mapping[str, VType],
        outputs: Mapping[str, VType],
        optional: frozenset[str] = frozenset(),
    ) -> Node:
        """The node's handle, its ports declared: the kinds it reads and those it gives."""
        node.input_ports.extend(_ports(inputs, optional))
        node.outputs.extend(_ports(outputs))
        return Node(self, node, outputs)

    def _body(self, body: Body, inputs: Mapping[str, VType]) -> tuple[cpb.Subgraph, dict]:
        sub = Graph(inputs)
        outs = body(sub)
        for key, ref in outs.items():
            sub.output(key, ref)
        return sub.to_subgraph(), {k: r.vtype for k, r in outs.items()}

    def switch(
        self,
        name: str,
        *,
        cases: list[tuple[str, cpb.Predicate, Body]],
        default: Body,
        outputs: Mapping[str, VType],
        retry: Retry | None = None,
        timeout_ms: int = 0,
        **inputs: Any,
    ) -> Node:
        """Run the body of the first case whose condition holds at run time, else ``default``.

        Conditions refer to values of this graph (inputs or node outputs).
        """
        node, types = self._control(name, inputs, retry, timeout_ms)
        for case_name, when, body in cases:
            sub, _ = self._body(body, types)
            node.switch.cases.add(name=case_name, when=when, body=sub)
        sub, _ = self._body(default, types)
        node.switch.default_body.CopyFrom(sub)
        return self._made(node, types, outputs)

    def loop(
        self,
        name: str,
        *,
        body: Body,
        until: Callable[[Mapping[str, Ref]], cpb.Predicate],
        max_iterations: int,
        timeout_ms: int = 0,
        **inputs: Any,
    ) -> Node:
        """Repeat ``body`` until ``until(outputs)`` holds or ``max_iterations`` ran.

        Body outputs named like body inputs feed the next iteration; the body may also
        read the input ``iteration`` (0, 1, ...).
        """
        node, types = self._control(name, inputs, None, timeout_ms)
        sub, out_types = self._body(body, {**types, "iteration": VType.INT})
        body_outs = {k: Ref(None, cpb.Source(graph_input=k), t) for k, t in out_types.items()}
        node.loop.body.CopyFrom(sub)
        node.loop.until.CopyFrom(until(body_outs))
        node.loop.max_iterations = max_iterations
        return self._made(node, types, out_types)

    def map(
        self,
        name: str,
        *,
        over: Ref,
        body: Body,
        item: str = "item",
        max_parallel: int = 0,
        retry: Retry | None = None,
        timeout_ms: int = 0,
        **inputs: Any,
    ) -> Node:
        """Run ``body`` once per element of the list ``over`` (bound to the body input
        ``item``); every output becomes the list of the bodies' outputs, in order."""
        node, types = self._control(name, {item: over, **inputs}, retry, timeout_ms)
        sub, out_types = self._body(body, {**types, item: VType.ANY})
        node.map.over, node.map.max_parallel = item, max_parallel
        node.map.body.CopyFrom(sub)
        return self._made(node, {**types, item: VType.LIST}, dict.fromkeys(out_types, VType.LIST))

    # -- compile
    def to_subgraph(self) -> cpb.Subgraph:
        sub = cpb.Subgraph(inputs=list(self._inputs.values()), nodes=self._nodes)
        for key, (ref, _) in self._outputs.items():
            sub.outputs[key].CopyFrom(ref.source)
        return sub


class Workflow(Graph):
    """A named workflow: a top-level graph with a description and a default deadline."""

    def __init__(self, name: str, *, description: str = "", deadline_ms: int = 0) -> None:
        super().__init__()
        self.name, self.description, self.deadline_ms = name, description, deadline_ms

    def compile(self) -> cpb.WorkflowGraph:
        """The graph message, validated; raises InvalidArgument naming the node at fault."""
        graph = cpb.WorkflowGraph(
            name=self.name,
            description=self.description,
            inputs=list(self._inputs.values()),
            nodes=self._nodes,
            default_deadline_ms=self.deadline_ms,
        )
        for key, (ref, vtype) in self._outputs.items():
            graph.outputs[key].CopyFrom(ref.source)
            graph.output_ports.add(name=key, type=int(vtype))
        validate_graph(graph)
        return graph
