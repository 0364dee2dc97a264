"""The kv-agent's Prometheus series: pages and bytes per tier, lookups, promotions,
demotions, evictions and checksum failures read from its stores at scrape time, and page
transfers per channel counted as they happen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from omniflow import telemetry
from omniflow.telemetry import Sample

if TYPE_CHECKING:
    from omniflow_services.kv_agent.pools import Pools
    from omniflow_services.kv_agent.tensors import TensorStore

TRANSFER_PAGES = Counter(
    "omniflow_kv_agent_transfer_pages_total",
    "KV pages moved agent to agent, by channel (grpc, nixl) and direction (in: pulled here)",
    ["channel", "direction"],
)
TRANSFER_BYTES = Counter(
    "omniflow_kv_agent_transfer_bytes_total",
    "Bytes of KV pages moved agent to agent, by channel and direction",
    ["channel", "direction"],
)


NIXL_GRANTS = Counter(
    "omniflow_kv_agent_nixl_grants_total",
    "NIXL grants by outcome: issued, released (Unpin), lapsed (the pin's deadline)",
    ["outcome"],
)
NIXL_GRANTED_SLOTS = Gauge(
    "omniflow_kv_agent_nixl_granted_slots",
    "Arena slots registered with NIXL now (under a live grant)",
)


def granted(outcome: str, slots: int) -> None:
    """A NIXL grant issued (``slots`` registered) or ended (released or lapsed)."""
    NIXL_GRANTS.labels(outcome).inc()
    NIXL_GRANTED_SLOTS.inc(slots if outcome == "issued" else -slots)


def transferred(channel: str, direction: str, pages: int, nbytes: int) -> None:
    if pages:
        TRANSFER_PAGES.labels(channel, direction).inc(pages)
        TRANSFER_BYTES.labels(channel, direction).inc(nbytes)


def watch(
    pools: Callable[[], Pools | None], tensors: Callable[[], TensorStore | None]
) -> Callable[[], None]:
    """Export the agent's stores on every scrape (None while it starts); returns the
    function that stops it."""
    return telemetry.add_sampler(lambda: _store_samples(pools(), tensors()))


def _store_samples(pools: Pools | None, tensors: TensorStore | None) -> Iterator[Sample]:
    if pools is None:
        return
    for pool in pools.all():
        st = pool.store.stats()
        for tier, pages, budget in (
            ("host", st.host_pages, st.host_budget),
            ("ssd", st.ssd_pages, st.ssd_budget),
        ):
            t = (("tier", tier),)
            yield Sample("omniflow_kv_agent_pages", "KV pages held, by tier", pages, t)
            yield Sample("omniflow_kv_agent_capacity_pages", "KV pages a tier can hold", budget, t)
            yield Sample(
                "omniflow_kv_agent_stored_bytes",
                "Bytes of KV pages held, by tier",
                pages * pool.page_bytes,
                t,
            )
        lookups = (("host_hit", st.host_hits), ("ssd_hit", st.ssd_hits), ("miss", st.misses))
        for result, n in lookups:
            yield Sample(
                "omniflow_kv_agent_lookups_total",
                "Page lookups by workers and peers: a host hit, an SSD hit or a miss",
                n,
                (("result", result),),
                counter=True,
            )
        for name, doc, n in (
            (
                "omniflow_kv_agent_promotions_total",
                "Pages promoted from SSD to host on a hit",
                st.ssd_hits,
            ),
            (
                "omniflow_kv_agent_demotions_total",
                "Pages demoted from host to SSD to make room",
                st.demoted,
            ),
            (
                "omniflow_kv_agent_evictions_total",
                "Pages dropped from the agent's last tier",
                st.dropped,
            ),
            (
                "omniflow_kv_agent_checksum_failures_total",
                "Pages refused or dropped because their checksum did not match",
                st.checksum_failures,
            ),
        ):
            yield Sample(name, doc, n, counter=True)
    if tensors is not None:
        yield Sample("omniflow_kv_agent_tensors", "Intermediate tensors held", len(tensors))
        held = tensors.used_bytes
        yield Sample("omniflow_kv_agent_tensor_bytes", "Bytes of intermediate tensors held", held)
