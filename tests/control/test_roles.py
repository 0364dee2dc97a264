"""The one table of roles and operations agrees with what the DSL, the topology and the
worker's settings accept."""

from __future__ import annotations

import pytest

from omniflow.dsl.ops import BUILTIN, BUILTIN_ROLES
from omniflow.errors import InvalidArgument
from omniflow.workers import MODEL_OPERATIONS, ROLE_OPERATIONS, ROLES


def test_every_dsl_operation_is_one_a_role_serves() -> None:
    served = {
        (r, o)
        for table in (ROLE_OPERATIONS, MODEL_OPERATIONS)
        for r, ops in table.items()
        for o in ops
    }
    assert set(BUILTIN) <= served, set(BUILTIN) - served
    assert BUILTIN_ROLES == set(ROLES) == set(ROLE_OPERATIONS)


def test_a_topology_accepts_exactly_the_table_roles() -> None:
    from omniflow.deploy.topology import parse_topology

    for role in ROLES:
        parse_topology(f"workers:\n  - {{role: {role}, count: 1}}\n")
    with pytest.raises(InvalidArgument, match="role 'painter' is not one of llm, encoder"):
        parse_topology("workers:\n  - {role: painter, count: 1}\n")
