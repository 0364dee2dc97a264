"""Router settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, setting


@dataclass(frozen=True, slots=True)
class RouterSettings(CommonSettings):
    """Settings of the router (plus the common ones)."""

    default_strategy: str = setting(
        "OMNIFLOW_ROUTER_STRATEGY",
        "round_robin",
        "strategy when a call names none",
        choices=("round_robin", "random"),
    )
    load_timeout_s: float = setting(
        "OMNIFLOW_ROUTER_LOAD_TIMEOUT_S", 0.5, "deadline of GetLoad calls to workers", minimum=0.01
    )
