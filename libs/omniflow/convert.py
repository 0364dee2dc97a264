"""Conversions between protobuf messages and the plain records cores use."""

from __future__ import annotations

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2
from omniflow.errors import InvalidArgument
from omniflow.workers import WorkerRecord


def worker_info(w: WorkerRecord, healthy: bool = True) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=w.worker_id,
        role=w.role,
        address=w.address,
        node=w.node,
        model=w.model,
        kv_namespace=w.kv_namespace,  # deprecated: the hex, for one release
        kv_namespace_id=w.namespace_id,
        operations=list(w.operations),
        metadata=w.metadata,
        healthy=healthy,
    )


def strategy_name(value: int, default: str) -> str:
    """``Strategy`` enum value → lower-case strategy name; rejects unknown numbers."""
    if value == router_pb2.STRATEGY_UNSPECIFIED:
        return default
    try:
        name = router_pb2.Strategy.Name(value)
    except ValueError:
        accepted = ", ".join(n for n in router_pb2.Strategy.keys() if n != "STRATEGY_UNSPECIFIED")
        raise InvalidArgument(f"unknown strategy {value}; accepted: {accepted}") from None
    return name.removeprefix("STRATEGY_").lower()


def strategy_value(name: str) -> int:
    return router_pb2.Strategy.Value("STRATEGY_" + name.upper())
