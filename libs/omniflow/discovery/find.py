"""One address of a service kind: "the kv-agent on my node", "a kv-index", "an encoder".

Every service that needs a single peer goes through :func:`find_address`: an address from
the settings wins; otherwise discovery is listed, optionally filtered, and an instance on
the caller's node is preferred (or, with ``same_node``, required: a node's shared-memory
arena is only reachable from that node).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from omniflow.discovery.base import Registry, ServiceInstance
from omniflow.errors import Unavailable

__all__ = ["find_address", "prefer_node"]


def prefer_node(instances: Iterable[ServiceInstance], node: str) -> list[ServiceInstance]:
    """``instances`` on ``node`` first, then the others, each group in the listing's order."""
    items = list(instances)
    if not node:
        return items
    return [i for i in items if i.metadata.get("node") == node] + [
        i for i in items if i.metadata.get("node") != node
    ]


async def find_address(
    registry: Registry | None,
    service: str,
    *,
    configured: str = "",
    node: str = "",
    same_node: bool = False,
    where: Callable[[ServiceInstance], bool] | None = None,
    what: str = "",
) -> str:
    """The address of one live instance of ``service``.

    ``configured`` (an address from the settings) is returned as is. Otherwise the
    instances ``where`` accepts are listed, those on ``node`` first; ``same_node`` keeps
    only those. ``what`` names the instance in the error (default: ``service``).

    Raises :class:`Unavailable` when there is no registry or nothing matches.
    """
    if configured:
        return configured
    name = what or service
    if registry is None:
        raise Unavailable(f"no discovery at hand to find a {name}")
    found = await registry.list(service)
    if where is not None:
        found = [i for i in found if where(i)]
    if same_node:
        found = [i for i in found if i.metadata.get("node") == node]
    if not found:
        on_node = f" on node {node!r}" if same_node else ""
        raise Unavailable(f"no {name} is registered in discovery{on_node}")
    return prefer_node(found, node)[0].address
