"""kv-agent settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, setting


@dataclass(frozen=True, slots=True)
class KVAgentSettings(CommonSettings):
    """Settings of a node's KV agent (plus the common ones)."""

    host_bytes: int = setting(
        "OMNIFLOW_KV_HOST_BYTES", 256 * 1024 * 1024, "host tier (shared memory) budget", minimum=0
    )
    ssd_path: str = setting("OMNIFLOW_KV_SSD_PATH", "", "SSD tier page file; empty: no SSD tier")
    ssd_bytes: int = setting(
        "OMNIFLOW_KV_SSD_BYTES", 1024 * 1024 * 1024, "SSD tier budget", minimum=0
    )
    index_addr: str = setting(
        "OMNIFLOW_KV_INDEX_ADDR", "", "kv-index address; empty: found through discovery"
    )
