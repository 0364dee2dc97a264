"""kv-index settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, setting


@dataclass(frozen=True, slots=True)
class KVIndexSettings(CommonSettings):
    """Settings of the KV index (plus the common ones; it uses OMNIFLOW_REDIS_URL)."""

    lease_ttl_ms: int = setting(
        "OMNIFLOW_KV_LEASE_TTL_MS", 5000, "owner lease time to live", minimum=100
    )
    max_hashes: int = setting(
        "OMNIFLOW_KV_MAX_HASHES", 65536, "most block hashes in one request", minimum=1
    )
    sweep_interval_s: float = setting(
        "OMNIFLOW_KV_SWEEP_INTERVAL_S",
        0.5,
        "how often the index drops lapsed owners, sweeps stale entries and checks that Redis "
        "kept its data",
        minimum=0.01,
    )
    key_prefix: str = setting(
        "OMNIFLOW_KV_KEY_PREFIX", "of:kv:", "prefix of the index's Redis keys"
    )
