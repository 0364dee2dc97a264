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
    max_snapshot_blocks: int = setting(
        "OMNIFLOW_KV_MAX_SNAPSHOT_BLOCKS",
        4_000_000,
        "most blocks in one owner's snapshot (the index buffers a snapshot whole)",
        minimum=1,
    )
    max_owners: int = setting(
        "OMNIFLOW_KV_MAX_OWNERS", 4096, "most live owners (workers and agents)", minimum=1
    )
    max_index_namespaces: int = setting(
        "OMNIFLOW_KV_MAX_INDEX_NAMESPACES", 1024, "most registered KV namespaces", minimum=1
    )
    max_page_bytes: int = setting(
        "OMNIFLOW_KV_MAX_PAGE_BYTES",
        1 << 30,
        "largest page a registered layout may describe (2 x layers x kv_heads x head_dim x "
        "dtype bytes x page_size)",
        minimum=1,
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
