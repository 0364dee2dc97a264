"""Operations a graph can call: the built-in ones of the table (``omniflow.operations``)
and those a user registers for their own roles.

The DSL checks node inputs and outputs against these when it builds a graph; the
compiled graph carries the ports, so the coordinator validates without this table.
"""

from __future__ import annotations

from omniflow.errors import InvalidArgument
from omniflow.operations import OPERATIONS, ROLES, Input, Operation, operation
from omniflow.values import VType

_USER: dict[tuple[str, str], Operation] = {}


def register_operation(
    role: str,
    operation_name: str,
    inputs: dict[str, VType],
    outputs: dict[str, VType],
    *,
    optional: tuple[str, ...] = (),
    streams: str = "",
) -> Operation:
    """Declare an operation a worker serves through ``Invoke`` so that graphs can call it."""
    if role in ROLES:
        raise InvalidArgument(
            f"{role}.{operation_name}: role {role!r} is built in and takes only the "
            "operations of the table (omniflow.operations); register under a role of your own"
        )
    op = Operation(
        role,
        operation_name,
        tuple(Input(n, t, optional=n in optional) for n, t in inputs.items()),
        dict(outputs),
        streams=streams,
    )
    _USER[(role, operation_name)] = op
    return op


def signature(role: str, operation_name: str) -> Operation:
    """The operation ``role.operation_name``; raises InvalidArgument naming what is known."""
    op = operation(role, operation_name) or _USER.get((role, operation_name))
    if op is not None:
        return op
    known = sorted(f"{o.role}.{o.name}" for o in (*OPERATIONS, *_USER.values()) if o.role == role)
    if known:
        raise InvalidArgument(
            f"unknown operation {operation_name!r} of role {role!r}; known: {', '.join(known)}"
        )
    roles = sorted({*ROLES, *(r for r, _ in _USER)})
    raise InvalidArgument(
        f"unknown role {role!r}; known: {', '.join(roles)} "
        "(declare a user operation with omniflow.dsl.register_operation)"
    )
