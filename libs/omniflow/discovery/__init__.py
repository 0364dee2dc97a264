"""Service discovery: register live instances, list and watch healthy ones.

Backends: ``redis`` (the single-machine default), ``consul`` (docker compose),
``static`` (a YAML/JSON file). Build one with :func:`make_registry`.
"""

from __future__ import annotations

from typing import Any

from omniflow.discovery.base import DiscoveryError, Registry, ServiceInstance
from omniflow.discovery.find import find_address, prefer_node
from omniflow.errors import InvalidArgument

__all__ = [
    "REGISTRY_KINDS",
    "DiscoveryError",
    "Registry",
    "ServiceInstance",
    "find_address",
    "make_registry",
    "prefer_node",
]

REGISTRY_KINDS = ("redis", "consul", "static")


def make_registry(kind: str, **options: Any) -> Registry:
    """Build a registry of ``kind`` ("redis" | "consul" | "static").

    ``options`` go to the backend's constructor: ``RedisRegistry(url, prefix=,
    timeout_s=, poll_interval_s=)``, ``ConsulRegistry(address, token=, check=,
    ...)``, ``StaticRegistry(path, poll_interval_s=)``.
    """
    # Imports are local so that a backend's client library loads only when used.
    cls: type[Registry]
    if kind == "redis":
        from omniflow.discovery.redis_backend import RedisRegistry as cls
    elif kind == "consul":
        from omniflow.discovery.consul_backend import ConsulRegistry as cls
    elif kind == "static":
        from omniflow.discovery.static_backend import StaticRegistry as cls
    else:
        raise InvalidArgument(
            f"unknown discovery backend {kind!r}: accepted values are {', '.join(REGISTRY_KINDS)}"
        )
    try:
        return cls(**options)
    except TypeError as exc:  # an unknown or missing option
        raise InvalidArgument(f"bad options for {kind} discovery: {exc}") from exc
