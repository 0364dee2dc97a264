"""The coordinator's Prometheus series: runs by state, runs in flight, and the latency of
each node call by role and operation."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from omniflow import telemetry
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb

RUNS = Counter(
    "omniflow_coordinator_runs_total",
    "Workflow runs by state: started, then succeeded, failed or cancelled",
    ["state"],
)
RUNS_IN_FLIGHT = Gauge("omniflow_coordinator_runs_in_flight", "Runs started and not finished")
ROUTER_FAILOVERS = Counter(
    "omniflow_coordinator_router_failovers_total",
    "Calls that found their router unreachable and moved to another",
)
NODE_SECONDS = Histogram(
    "omniflow_coordinator_node_seconds",
    "Time of one node call attempt, from its pick to its answer, by role, operation, outcome",
    ["role", "operation", "outcome"],
    buckets=telemetry.LATENCY_BUCKETS,
)

_STATE = {
    cpb.RUN_STATE_SUCCEEDED: "succeeded",
    cpb.RUN_STATE_FAILED: "failed",
    cpb.RUN_STATE_CANCELLED: "cancelled",
}


def run_started() -> None:
    RUNS.labels("started").inc()
    RUNS_IN_FLIGHT.inc()


def run_finished(state: int) -> None:
    RUNS.labels(_STATE.get(state, "failed")).inc()
    RUNS_IN_FLIGHT.dec()


def node_called(role: str, operation: str, code: str, seconds: float) -> None:
    """``code`` is "OK" or the error's status code name."""
    NODE_SECONDS.labels(role, operation, code).observe(seconds)
