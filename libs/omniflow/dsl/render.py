"""Pictures of a workflow graph: Mermaid (``flowchart``) and Graphviz (``dot``).

Bodies of switch, loop and map nodes are drawn as nested clusters; streaming edges are
dotted, conditions label the edges into switch cases. A constant gets its own small box in
the graph (or body) that reads it, drawn before its first edge.
"""

from __future__ import annotations

from collections.abc import Iterable

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.values import brief, to_python

_OPS = {
    cpb.Predicate.OP_EQUALS: "==",
    cpb.Predicate.OP_NOT_EQUALS: "!=",
    cpb.Predicate.OP_LESS: "<",
    cpb.Predicate.OP_GREATER: ">",
    cpb.Predicate.OP_CONTAINS: "contains",
    cpb.Predicate.OP_TRUTHY: "is truthy",
    cpb.Predicate.OP_PRESENT: "is present",
}


def describe_source(src: cpb.Source) -> str:
    kind = src.WhichOneof("kind")
    if kind == "graph_input":
        return src.graph_input
    if kind == "node_output":
        return f"{src.node_output.node}.{src.node_output.output}"
    return brief(to_python(src.constant), 24)


def describe_predicate(pred: cpb.Predicate) -> str:
    target = describe_source(pred.value) + (f".{pred.field}" if pred.field else "")
    op = _OPS.get(pred.op, "?")
    if pred.op in (cpb.Predicate.OP_TRUTHY, cpb.Predicate.OP_PRESENT):
        return f"{target} {op}"
    return f"{target} {op} {brief(to_python(pred.operand), 24)}"


def _label(node: cpb.Node) -> str:
    kind = node.WhichOneof("kind")
    extra = []
    if node.retry.max_attempts > 1:
        extra.append(f"retry {node.retry.max_attempts}")
    if node.timeout_ms:
        extra.append(f"{node.timeout_ms} ms")
    if node.max_concurrency:
        extra.append(f"max {node.max_concurrency}")
    if kind == "call":
        head = f"{node.name}\\n{node.call.role}.{node.call.operation}"
    elif kind == "loop":
        head = f"{node.name}\\nloop until {describe_predicate(node.loop.until)}"
        extra.append(f"max {node.loop.max_iterations} iterations")
    elif kind == "map":
        head = f"{node.name}\\nmap over {node.map.over}"
    else:
        head = f"{node.name}\\nswitch"
    return head + (f"\\n({', '.join(extra)})" if extra else "")


class _Drawer:
    """Walks the graph once and emits the lines of either format."""

    def __init__(self, mermaid: bool) -> None:
        self.mermaid = mermaid
        self.lines: list[str] = []
        self._ids: dict[str, str] = {}
        self._constants: set[str] = set()  # paths of the constant boxes drawn so far

    def nid(self, path: str) -> str:
        if path not in self._ids:
            self._ids[path] = f"n{len(self._ids)}"
        return self._ids[path]

    def box(self, path: str, label: str, shape: str = "box", indent: str = "  ") -> None:
        text = label.replace('"', "'")
        if self.mermaid:
            text = text.replace("\\n", "<br/>")
            left, right = {"box": ("[", "]"), "io": ("([", "])"), "diamond": ("{", "}")}[shape]
            self.lines.append(f'{indent}{self.nid(path)}{left}"{text}"{right}')
        else:
            dot_shape = {"box": "box", "io": "ellipse", "diamond": "diamond"}[shape]
            self.lines.append(f'{indent}{self.nid(path)} [label="{text}", shape={dot_shape}];')

    def edge(self, a: str, b: str, label: str = "", streaming: bool = False) -> None:
        la, lb = self.nid(a), self.nid(b)
        label = label.replace('"', "'")
        if self.mermaid:
            arrow = "-.->" if streaming else "-->"
            self.lines.append(f"  {la} {arrow}{f'|{label}|' if label else ''} {lb}")
        else:
            attrs = []
            if label:
                attrs.append(f'label="{label}"')
            if streaming:
                attrs.append("style=dashed")
            self.lines.append(f"  {la} -> {lb}{f' [{chr(44).join(attrs)}]' if attrs else ''};")

    def open_cluster(self, path: str, title: str) -> None:
        title = title.replace('"', "'")
        if self.mermaid:
            self.lines.append(f'  subgraph {self.nid(path + "#c")}["{title}"]')
        else:
            self.lines.append(f"  subgraph cluster_{self.nid(path + '#c')} {{")
            self.lines.append(f'    label="{title}";')

    def close_cluster(self) -> None:
        self.lines.append("  end" if self.mermaid else "  }")

    def graph(
        self,
        prefix: str,
        inputs: Iterable[cpb.Port],
        nodes: Iterable[cpb.Node],
        outputs: dict[str, cpb.Source],
    ) -> None:
        for port in inputs:
            self.box(f"{prefix}in:{port.name}", port.name, "io")
        for node in nodes:
            path = f"{prefix}{node.name}"
            self.box(path, _label(node), "diamond" if node.HasField("switch") else "box")
            for key, src in node.inputs.items():
                self.edge(self.source(prefix, src), path, key, src.streaming)
            for i, body, title in self._bodies(node):
                sub = f"{path}/{i}/"
                self.open_cluster(sub, title)
                self.graph(sub, body.inputs, body.nodes, body.outputs)
                self.close_cluster()
                if body.nodes:
                    self.edge(path, f"{sub}{body.nodes[0].name}", title)
        for key, src in outputs.items():
            self.box(f"{prefix}out:{key}", key, "io")
            self.edge(self.source(prefix, src), f"{prefix}out:{key}")

    def source(self, prefix: str, src: cpb.Source) -> str:
        """The path an edge from ``src`` starts at; a constant's box is drawn here, in the
        graph or body that reads it, the first time it is read."""
        path = self._src_path(prefix, src)
        if src.WhichOneof("kind") == "constant" and path not in self._constants:
            self._constants.add(path)
            self.box(path, describe_source(src), "io")
        return path

    @staticmethod
    def _src_path(prefix: str, src: cpb.Source) -> str:
        if src.HasField("node_output"):
            return f"{prefix}{src.node_output.node}"
        if src.HasField("graph_input"):
            return f"{prefix}in:{src.graph_input}"
        return f"{prefix}const:{describe_source(src)}"

    @staticmethod
    def _bodies(node: cpb.Node) -> list[tuple[str, cpb.Subgraph, str]]:
        if node.HasField("switch"):
            out = [
                (c.name, c.body, f"{c.name}: {describe_predicate(c.when)}")
                for c in node.switch.cases
            ]
            return [*out, ("default", node.switch.default_body, "default")]
        if node.HasField("loop"):
            return [("body", node.loop.body, f"{node.name} body")]
        if node.HasField("map"):
            return [("body", node.map.body, f"{node.name} body (per item)")]
        return []


def _draw(graph: cpb.WorkflowGraph, mermaid: bool) -> list[str]:
    drawer = _Drawer(mermaid)
    drawer.graph("", graph.inputs, graph.nodes, graph.outputs)
    return drawer.lines


def to_mermaid(graph: cpb.WorkflowGraph) -> str:
    """A Mermaid ``flowchart TD`` of the graph."""
    title = f"%% {graph.name} v{graph.version}" if graph.version else f"%% {graph.name}"
    return "\n".join([title, "flowchart TD", *_draw(graph, True)]) + "\n"


def to_dot(graph: cpb.WorkflowGraph) -> str:
    """A Graphviz ``digraph`` of the graph."""
    head = [f'digraph "{graph.name}" {{', "  rankdir=TB;", '  node [fontname="Helvetica"];']
    return "\n".join([*head, *_draw(graph, False), "}"]) + "\n"
