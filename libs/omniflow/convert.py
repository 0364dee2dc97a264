"""Conversions between protobuf messages and the plain records cores use."""

from __future__ import annotations

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2
from omniflow.errors import InvalidArgument
from omniflow.records import build
from omniflow.workers import WorkerRecord


def worker_info(w: WorkerRecord, healthy: bool = True) -> common_pb2.WorkerInfo:
    # kv_namespace (the deprecated hex) is copied as it is, for one release.
    return build(common_pb2.WorkerInfo, w, kv_namespace_id=w.namespace_id, healthy=healthy)


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
