"""The workflow DSL: build a typed dataflow graph in Python, compile it to the
coordinator's ``WorkflowGraph``, validate it, and draw it.

See :mod:`omniflow.dsl.builder` for the API and ``examples/workflows/`` for examples.
"""

from omniflow.dsl.builder import Graph, Node, Ref, Retry, Workflow, const
from omniflow.dsl.ops import register_operation, signature
from omniflow.dsl.render import to_dot, to_mermaid
from omniflow.dsl.validate import validate_graph
from omniflow.operations import Operation
from omniflow.values import Tokens, VType

__all__ = [
    "Graph",
    "Node",
    "Operation",
    "Ref",
    "Retry",
    "Tokens",
    "VType",
    "Workflow",
    "const",
    "register_operation",
    "signature",
    "to_dot",
    "to_mermaid",
    "validate_graph",
]
