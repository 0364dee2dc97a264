"""The router's Prometheus series: picks by strategy and worker, Pick latency, and the
worker table (breaker states, live workers, kv_aware fallbacks) read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram

from omniflow import telemetry
from omniflow.routing.table import PickResult, WorkerTable
from omniflow.telemetry import Sample

PICKS = Counter(
    "omniflow_router_picks_total",
    "Workers picked, by role, the strategy that decided and the worker",
    ["role", "strategy", "worker"],
)
PICK_SECONDS = Histogram(
    "omniflow_router_pick_seconds",
    "Time to pick a worker (for kv_aware, with the index's answer)",
    ["strategy"],
    buckets=telemetry.LATENCY_BUCKETS,
)

BREAKER_STATES = ("closed", "half_open", "open")
# WorkerTable.counters that are fallbacks of kv_aware, by the reason they name.
_FALLBACK = "kv_fallback_"


def picked(result: PickResult, seconds: float) -> None:
    w = result.worker
    PICKS.labels(w.role, result.strategy, w.worker_id).inc()
    PICK_SECONDS.labels(result.strategy).observe(seconds)


def watch(table: WorkerTable) -> Callable[[], None]:
    """Export ``table`` on every scrape; returns the function that stops it."""
    return telemetry.add_sampler(lambda: _table_samples(table))


def _table_samples(table: WorkerTable) -> Iterator[Sample]:
    for wid, state in table.breakers().items():
        for s in BREAKER_STATES:
            yield Sample(
                "omniflow_router_breaker_state",
                "Circuit breaker of each worker: 1 for its current state",
                1.0 if s == state else 0.0,
                (("worker", wid), ("state", s)),
            )
    for role, n in table.roles().items():
        yield Sample("omniflow_router_workers", "Live workers by role", n, (("role", role),))
    counters = dict(table.counters)
    for reason in ("off", "timeout", "error"):
        yield Sample(
            "omniflow_router_kv_fallbacks_total",
            "kv_aware picks made by load only, by why the index gave no answer",
            counters.get(_FALLBACK + reason, 0),
            (("reason", reason),),
            counter=True,
        )
    for event in ("breaker_opened", "all_breakers_open", "proxy_retries"):
        yield Sample(
            "omniflow_router_events_total",
            "Breakers opened, picks with every breaker open, proxied calls retried",
            counters.get(event, 0),
            (("event", event),),
            counter=True,
        )
