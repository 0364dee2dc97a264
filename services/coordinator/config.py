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
