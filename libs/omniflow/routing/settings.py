"""Settings of the pick policy, read by every process that runs it (the router, the
gateway): the same variables give the same picks wherever the pick is made."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, peer_address, setting
from omniflow.errors import InvalidArgument
from omniflow.routing.table import STRATEGIES


@dataclass(frozen=True, slots=True)
class PickSettings(CommonSettings):
    """The pick policy's settings (plus the common ones)."""

    default_strategy: str = setting(
        "OMNIFLOW_ROUTER_STRATEGY",
        "round_robin",
        "strategy when a call names none and its role has no entry in role strategies",
        choices=STRATEGIES,
    )
    role_strategies: str = setting(
        "OMNIFLOW_ROUTER_ROLE_STRATEGIES",
        "",
        "per-role default strategies, e.g. 'llm=kv_aware,encoder=least_outstanding'",
    )
    load_timeout_s: float = setting(
        "OMNIFLOW_ROUTER_LOAD_TIMEOUT_S", 0.5, "deadline of GetLoad calls to workers", minimum=0.01
    )
    health_interval_s: float = setting(
        "OMNIFLOW_ROUTER_HEALTH_INTERVAL_S",
        1.0,
        "how often workers' load and health are polled; 0: never",
        minimum=0,
    )
    kv_index: str = setting(
        "OMNIFLOW_ROUTER_KV_INDEX",
        "auto",
        "how kv_aware reaches the KV index: its gRPC MatchPrefix, the index's Redis "
        "directly (one round trip, no hop through the kv-index), auto (redis when "
        "OMNIFLOW_REDIS_URL is set, as the kv-index reads it, else grpc), or off (load only)",
        choices=("auto", "grpc", "redis", "off"),
    )
    kv_index_addr: str = peer_address("OMNIFLOW_KV_INDEX_ADDR", "kv-index address")
    kv_key_prefix: str = setting(
        "OMNIFLOW_KV_KEY_PREFIX", "of:kv:", "prefix of the index's Redis keys"
    )  # the kv-index's own setting: the redis path reads the same keys
    kv_index_timeout_s: float = setting(
        "OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S",
        0.05,
        "deadline of a prefix match; past it kv_aware picks by load only",
        minimum=0.001,
    )
    kv_load_weight: float = setting(
        "OMNIFLOW_ROUTER_KV_LOAD_WEIGHT",
        1.0,
        "kv_aware: cost of one outstanding request, in prompt blocks",
        minimum=0,
    )
    kv_temperature: float = setting(
        "OMNIFLOW_ROUTER_KV_TEMPERATURE",
        0.0,
        "kv_aware: sample among near-equal workers (0: always the cheapest)",
        minimum=0,
    )
    link_gbps: float = setting(
        "OMNIFLOW_ROUTER_LINK_GBPS",
        0.0,
        "kv_aware: Gbit/s between nodes, pricing a pull of KV pages from another node "
        "against recomputing them (a worker's link_gbps metadata overrides; 0: never pull)",
        minimum=0,
    )
    prefill_tokens_s: float = setting(
        "OMNIFLOW_ROUTER_PREFILL_TOKENS_S",
        0.0,
        "kv_aware: a worker's prefill speed in tokens/s, the recompute a pull is weighed "
        "against (a worker's prefill_tokens_s metadata overrides; 0: never pull)",
        minimum=0,
    )
    breaker_threshold: int = setting(
        "OMNIFLOW_ROUTER_BREAKER_THRESHOLD",
        3,
        "failures in a row that open a worker's circuit breaker",
        minimum=1,
    )
    breaker_cooldown_s: float = setting(
        "OMNIFLOW_ROUTER_BREAKER_COOLDOWN_S",
        2.0,
        "seconds an open breaker waits before one trial call",
        minimum=0,
    )

    def strategy_for(self, role: str) -> str:
        """The default strategy of ``role``."""
        for entry in self.role_strategies.split(","):
            name, _, strategy = entry.strip().partition("=")
            if name == role and strategy:
                if strategy not in STRATEGIES:
                    raise InvalidArgument(
                        f"OMNIFLOW_ROUTER_ROLE_STRATEGIES names {strategy!r}; accepted: "
                        f"{', '.join(STRATEGIES)}"
                    )
                return strategy
        return self.default_strategy
