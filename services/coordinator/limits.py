"""Bounds on what a caller can make the coordinator hold: workflow inputs and graphs.

Each limit is a setting; every error names the limit, the value seen, and the variable
that raises it. No gRPC here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class RunLimits:
    """The coordinator's input bounds (see ``CoordinatorSettings`` for the variables)."""

    max_inline_bytes: int = 4 * 1024 * 1024
    max_input_bytes: int = 16 * 1024 * 1024
    max_graph_nodes: int = 1024
    max_graph_depth: int = 16
    max_graph_bytes: int = 1024 * 1024


def _over(what: str, seen: int, limit: int, setting: str) -> InvalidArgument:
    return InvalidArgument(f"{what} is {seen}; the limit is {limit} (raise it with {setting})")


_INLINE = {"text": "text", "bytes_value": "bytes", "media": "a media item"}


def check_inputs_size(limits: RunLimits, inputs: Mapping[str, common_pb2.Value]) -> None:
    """All inputs together, serialized, within ``max_input_bytes``; each text or bytes
    value within ``max_inline_bytes`` (larger data goes as a TensorRef)."""
    total = 0
    for name, value in inputs.items():
        size = value.ByteSize()
        total += size
        kind = value.WhichOneof("kind")
        if kind in _INLINE and size > limits.max_inline_bytes:
            raise _over(
                f"the size of input {name!r} ({_INLINE[kind]}, inline) in bytes",
                size,
                limits.max_inline_bytes,
                "OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES; pass large data as a TensorRef",
            )
    if total > limits.max_input_bytes:
        raise _over(
            "the size of all inputs together in bytes",
            total,
            limits.max_input_bytes,
            "OMNIFLOW_COORDINATOR_MAX_INPUT_BYTES",
        )


def _bodies(node: cpb.Node) -> Iterator[cpb.Subgraph]:
    kind = node.WhichOneof("kind")
    if kind == "switch":
        yield from (case.body for case in node.switch.cases)
        yield node.switch.default_body
    elif kind == "loop":
        yield node.loop.body
    elif kind == "map":
        yield node.map.body


def graph_shape(nodes: list[cpb.Node]) -> tuple[int, int]:
    """(nodes in all bodies together, nesting depth: 1 for a flat graph)."""
    count, depth = 0, 1
    stack: list[tuple[list[cpb.Node], int]] = [(nodes, 1)]
    while stack:
        level, d = stack.pop()
        count += len(level)
        depth = max(depth, d)
        for node in level:
            stack.extend((list(body.nodes), d + 1) for body in _bodies(node))
    return count, depth


def check_graph(limits: RunLimits, graph: cpb.WorkflowGraph) -> None:
    """The graph's size in bytes, its node count and its nesting depth within bounds."""
    size = graph.ByteSize()
    if size > limits.max_graph_bytes:
        raise _over(
            f"workflow {graph.name!r} in bytes",
            size,
            limits.max_graph_bytes,
            "OMNIFLOW_COORDINATOR_MAX_GRAPH_BYTES",
        )
    # Checked iteratively: protobuf itself refuses messages nested beyond 100 levels.
    count, depth = graph_shape(list(graph.nodes))
    if count > limits.max_graph_nodes:
        raise _over(
            f"the number of nodes of workflow {graph.name!r} (all bodies included)",
            count,
            limits.max_graph_nodes,
            "OMNIFLOW_COORDINATOR_MAX_GRAPH_NODES",
        )
    if depth > limits.max_graph_depth:
        raise _over(
            f"the nesting depth of workflow {graph.name!r} (switch, loop and map bodies)",
            depth,
            limits.max_graph_depth,
            "OMNIFLOW_COORDINATOR_MAX_GRAPH_DEPTH",
        )
