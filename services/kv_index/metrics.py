"""The kv-index's Prometheus series: events ingested by kind, snapshots, MatchPrefix
latency, and the index's size (owners, blocks per tier), refreshed from Redis on a timer
(a scrape runs on a thread that cannot await the core)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from omniflow import telemetry
from omniflow.kv.events import BlockEvent
from omniflow.kv.index_store import KVIndex

log = logging.getLogger(__name__)

EVENTS = Counter(
    "omniflow_kv_index_events_total",
    "Block events applied, by kind (stored, removed, cleared, cleared_tier)",
    ["kind"],
)
BATCHES = Counter(
    "omniflow_kv_index_batches_total",
    "Event batches received, by outcome (accepted, or why refused: the lease status)",
    ["outcome"],
)
SNAPSHOTS = Counter("omniflow_kv_index_snapshots_total", "Owner snapshots applied")
SNAPSHOT_BLOCKS = Counter(
    "omniflow_kv_index_snapshot_blocks_total", "Blocks received in owner snapshots"
)
MATCH_SECONDS = Histogram(
    "omniflow_kv_index_match_prefix_seconds",
    "Time to answer MatchPrefix (one Redis round trip)",
    buckets=telemetry.LATENCY_BUCKETS,
)
MATCH_BLOCKS = Counter(
    "omniflow_kv_index_match_prefix_blocks_total",
    "Block hashes asked for in MatchPrefix, and the longest prefix held (result=asked|held)",
    ["result"],
)
OWNERS = Gauge("omniflow_kv_index_owners", "Owners with a live lease")
BLOCKS = Gauge(
    "omniflow_kv_index_blocks", "(owner, block) entries of live owners, by tier", ["tier"]
)


def ingested(events: Iterable[BlockEvent]) -> None:
    counts: dict[str, int] = {}
    for ev in events:
        name = ev.kind.name.lower()
        counts[name] = counts.get(name, 0) + 1
    for name, n in counts.items():
        EVENTS.labels(name).inc(n)


async def refresh_loop(core: KVIndex, interval_s: float, stop: asyncio.Event) -> None:
    """Read the index's size into the gauges every ``interval_s`` until ``stop``."""
    while not stop.is_set():
        try:
            st = await core.stats()
        except Exception as exc:  # Redis away: the gauges keep their last value
            log.debug("kv index stats for metrics failed: %s", exc)
        else:
            OWNERS.set(st.live_owners)
            for tier, n in st.blocks_per_tier.items():
                BLOCKS.labels(tier).set(n)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
