"""kv-agent settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, peer_address, setting


@dataclass(frozen=True, slots=True)
class KVAgentSettings(CommonSettings):
    """Settings of a node's KV agent (plus the common ones)."""

    host_bytes: int = setting(
        "OMNIFLOW_KV_HOST_BYTES",
        256 * 1024 * 1024,
        "host tier (shared memory) budget, per page size in use",
        minimum=0,
    )
    ssd_path: str = setting(
        "OMNIFLOW_KV_SSD_PATH",
        "",
        "SSD tier page files: <path>.<page bytes>, one per page size; empty: no SSD tier",
    )
    ssd_bytes: int = setting(
        "OMNIFLOW_KV_SSD_BYTES", 1024 * 1024 * 1024, "SSD tier budget, per page size", minimum=0
    )
    index_addr: str = peer_address("OMNIFLOW_KV_INDEX_ADDR", "kv-index address")
    lease_ms: int = setting(
        "OMNIFLOW_KV_AGENT_LEASE_MS", 0, "lease asked of the index; 0: the index default", minimum=0
    )
    publish_interval_ms: int = setting(
        "OMNIFLOW_KV_PUBLISH_INTERVAL_MS", 20, "how often block events go to the index", minimum=1
    )
    chunk_bytes: int = setting(
        "OMNIFLOW_KV_CHUNK_BYTES", 4 * 1024 * 1024, "bytes per streamed page chunk", minimum=1024
    )
    max_chunk_bytes: int = setting(
        "OMNIFLOW_KV_MAX_CHUNK_BYTES",
        16 * 1024 * 1024,
        "largest page chunk accepted; larger ones are INVALID_ARGUMENT",
        minimum=1024,
    )
    pull_streams: int = setting(
        "OMNIFLOW_KV_PULL_STREAMS", 2, "concurrent GetPages streams of one gRPC pull", minimum=1
    )
    pin_ttl_ms: int = setting(
        "OMNIFLOW_KV_PIN_TTL_MS",
        30_000,
        "how long pages located for a local reader stay pinned without Unpin",
        minimum=100,
    )
    max_pin_ttl_ms: int = setting(
        "OMNIFLOW_KV_MAX_PIN_TTL_MS",
        300_000,
        "longest pin a reader may ask for (longer asks are cut to this)",
        minimum=100,
    )
    max_reservation_ttl_ms: int = setting(
        "OMNIFLOW_KV_MAX_RESERVATION_TTL_MS",
        60_000,
        "longest slot reservation a writer may ask for (longer asks are cut to this)",
        minimum=100,
    )
    max_arenas: int = setting(
        "OMNIFLOW_KV_MAX_ARENAS",
        4,
        "most page sizes (one host arena of OMNIFLOW_KV_HOST_BYTES each) an agent serves",
        minimum=1,
    )
    max_namespaces: int = setting(
        "OMNIFLOW_KV_MAX_NAMESPACES",
        64,
        "most KV namespaces an agent serves",
        minimum=1,
    )
    shm_tag: str = setting(
        "OMNIFLOW_KV_SHM_TAG",
        "",
        "added to the agent's shared-memory names so that two topologies on one machine "
        "never share one (omniflow up sets it from its run folder); [A-Za-z0-9._-]",
    )
    channels: tuple[str, ...] = setting(
        "OMNIFLOW_KV_CHANNELS",
        ("grpc", "nixl"),
        "agent-to-agent channels to offer (nixl only where it imports)",
    )
    nixl_devices: str = setting(
        "OMNIFLOW_KV_NIXL_DEVICES",
        "",
        "network devices NIXL's UCX listens and sends on (UCX_NET_DEVICES, e.g. eth1 or "
        "mlx5_0:1); empty: the interface holding OMNIFLOW_HOST (lo on 127.0.0.1); all: every one",
    )
    tensor_bytes: int = setting(
        "OMNIFLOW_KV_TENSOR_BYTES", 256 * 1024 * 1024, "budget of held tensors", minimum=0
    )
    tensor_ttl_s: float = setting(
        "OMNIFLOW_KV_TENSOR_TTL_S", 300.0, "default time to live of tensors", minimum=0.001
    )
