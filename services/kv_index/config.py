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
