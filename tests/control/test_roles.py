"""The roles of the table of operations are those a topology accepts (what each operation
takes, and who reads it: tests/control/test_operations_table.py)."""

from __future__ import annotations

import pytest

from omniflow.errors import InvalidArgument
from omniflow.operations import OPERATIONS, ROLES


def test_every_role_has_operations_and_every_operation_a_role() -> None:
    assert {op.role for op in OPERATIONS} == set(ROLES)


def test_a_topology_accepts_exactly_the_table_roles() -> None:
    from omniflow.deploy.topology import parse_topology

    for role in ROLES:
        parse_topology(f"workers:\n  - {{role: {role}, count: 1}}\n")
    with pytest.raises(InvalidArgument, match="role 'painter' is not one of llm, encoder"):
        parse_topology("workers:\n  - {role: painter, count: 1}\n")
