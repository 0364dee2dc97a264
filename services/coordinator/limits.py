"""Bounds on what a caller can make the coordinator hold: workflow inputs and graphs.

Each limit is a setting; every error names the limit, the value seen, and the variable
that raises it. No gRPC here.
"""

from __future__ import annotations

import re
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
    #: Fair share: runs in progress of one tenant (0: no limit of its own); the deadline
    #: every run gets at most (and when it asks none); the longest retry backoff.
    tenant_max_runs: int = 64
    max_run_deadline_ms: int = 3_600_000
    max_retry_backoff_ms: int = 30_000


#: A run id a client chooses: letters, digits, ``-``, ``_`` and ``.``, at most 128. No ``:``,
#: so that no run's id names another run's Redis keys (``X:events``).
RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_run_id(run_id: str) -> None:
    """InvalidArgument for a client-chosen run id outside ``RUN_ID``."""
    if not RUN_ID.fullmatch(run_id):
        shown = run_id if len(run_id) <= 64 else run_id[:64] + "..."
        raise InvalidArgument(
            f"run id {shown!r} ({len(run_id)} characters) is not accepted: use 1 to 128 "
            "letters, digits, '-', '_' or '.' (or leave it empty for one made here)"
        )


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


def call_roles(nodes: list[cpb.Node]) -> set[str]:
    """Every worker role the call nodes of ``nodes`` (bodies included) call."""
    roles: set[str] = set()
    stack = [nodes]
    while stack:
        for node in stack.pop():
            if node.WhichOneof("kind") == "call" and node.call.role:
                roles.add(node.call.role)
            stack.extend(list(body.nodes) for body in _bodies(node))
    return roles


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
