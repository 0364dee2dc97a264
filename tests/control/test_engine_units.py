"""Pieces of the run engine that need no process: conditions, joining chunk outputs,
concurrency keys, input checks of a run."""

from __future__ import annotations

import pytest

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.dsl import VType, Workflow
from omniflow.values import from_python
from omniflow_services.coordinator.executor import _strip_indices, evaluate
from omniflow_services.coordinator.streams import join as _join


def pred(op: int, operand=None, field: str = "") -> cpb.Predicate:
    p = cpb.Predicate(op=op, field=field)
    if operand is not None:
        p.operand.CopyFrom(from_python(operand))
    return p


@pytest.mark.parametrize(
    ("op", "operand", "value", "field", "holds"),
    [
        (cpb.Predicate.OP_EQUALS, "math", "math", "", True),
        (cpb.Predicate.OP_EQUALS, "math", "chat", "", False),
        (cpb.Predicate.OP_NOT_EQUALS, 1, 2, "", True),
        (cpb.Predicate.OP_LESS, 0.5, 0.25, "", True),
        (cpb.Predicate.OP_GREATER, 3, 2, "", False),
        (cpb.Predicate.OP_GREATER, 3, "text", "", False),  # incomparable: does not hold
        (cpb.Predicate.OP_CONTAINS, "DONE", "all DONE.", "", True),
        (cpb.Predicate.OP_CONTAINS, 2, [1, 2, 3], "", True),
        (cpb.Predicate.OP_CONTAINS, "x", None, "", False),
        (cpb.Predicate.OP_TRUTHY, None, "", "", False),
        (cpb.Predicate.OP_TRUTHY, None, [0], "", True),
        (cpb.Predicate.OP_PRESENT, None, None, "", False),
        (cpb.Predicate.OP_PRESENT, None, "", "", True),
        (cpb.Predicate.OP_EQUALS, "cat", {"label": {"name": "cat"}}, "label.name", True),
        (cpb.Predicate.OP_PRESENT, None, {"label": {}}, "label.name", False),
    ],
)
def test_conditions(op, operand, value, field, holds):
    assert evaluate(pred(op, operand, field), value) is holds


def test_join_of_per_chunk_outputs():
    assert _join(["a", "b"]) == "ab"
    assert _join([b"\x00", b"\x01"]) == b"\x00\x01"
    assert _join([[1], [2, 3]]) == [1, 2, 3]
    assert _join([16000, 16000]) == 16000
    assert _join([]) is None


def test_concurrency_key_drops_iteration_indices():
    assert _strip_indices("each[3]/inner[12]/call") == "each/inner/call"


def test_workflow_inputs_keep_their_ports():
    wf = Workflow("w")
    wf.output("o", wf.input("t", VType.TEXT, optional=True))
    # a graph with no node is refused: there is nothing to run
    with pytest.raises(Exception, match="has no nodes"):
        wf.compile()
