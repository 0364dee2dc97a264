"""Coordinator settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, setting


@dataclass(frozen=True, slots=True)
class CoordinatorSettings(CommonSettings):
    """Settings of the coordinator (plus the common ones; run records go to OMNIFLOW_REDIS_URL)."""

    router_addr: str = setting(
        "OMNIFLOW_ROUTER_ADDR", "", "router address; empty: found through discovery"
    )
    max_runs: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_RUNS", 256, "runs in progress at once", minimum=1
    )
    run_ttl_s: float = setting(
        "OMNIFLOW_COORDINATOR_RUN_TTL_S", 86_400.0, "seconds finished runs stay in Redis", minimum=1
    )
    max_inline_bytes: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES",
        4 * 1024 * 1024,
        "largest bytes value passed inline; larger data goes as a TensorRef",
        minimum=0,
    )
    node_timeout_s: float = setting(
        "OMNIFLOW_COORDINATOR_NODE_TIMEOUT_S",
        300.0,
        "deadline of a node call when neither the node nor the run sets one",
        minimum=0.001,
    )
    pick_timeout_s: float = setting(
        "OMNIFLOW_COORDINATOR_PICK_TIMEOUT_S",
        2.0,
        "deadline of Pick calls to the router",
        minimum=0.001,
    )
