"""Coordinator settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, peer_address, setting


@dataclass(frozen=True, slots=True)
class CoordinatorSettings(CommonSettings):
    """Settings of the coordinator (plus the common ones; run records go to OMNIFLOW_REDIS_URL)."""

    router_addr: str = peer_address("OMNIFLOW_ROUTER_ADDR", "router address")
    max_runs: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_RUNS", 256, "runs in progress at once", minimum=1
    )
    run_ttl_s: float = setting(
        "OMNIFLOW_COORDINATOR_RUN_TTL_S", 86_400.0, "seconds finished runs stay in Redis", minimum=1
    )
    max_inline_bytes: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES",
        4 * 1024 * 1024,
        "largest bytes value passed inline; larger data goes as a TensorRef",
        minimum=0,
    )
    max_input_bytes: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_INPUT_BYTES",
        16 * 1024 * 1024,
        "largest size of a run's inputs together (serialized); runs and their records "
        "are kept in memory and in Redis",
        minimum=0,
    )
    max_graph_nodes: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_GRAPH_NODES",
        1024,
        "most nodes in a workflow graph, nested bodies included",
        minimum=1,
    )
    max_graph_depth: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_GRAPH_DEPTH",
        16,
        "deepest nesting of switch, loop and map bodies in a workflow graph",
        minimum=1,
    )
    max_graph_bytes: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_GRAPH_BYTES",
        1024 * 1024,
        "largest serialized workflow graph",
        minimum=1,
    )
    max_prompt_bytes: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_PROMPT_BYTES",
        1 << 20,
        "largest llm prompt (UTF-8 bytes) the coordinator templates and tokenizes for KV "
        "hints; a larger one goes to the worker as it is, whose own bound refuses it",
        minimum=1,
    )
    tenant_max_runs: int = setting(
        "OMNIFLOW_COORDINATOR_TENANT_MAX_RUNS",
        64,
        "runs in progress at once of one tenant (fair share of OMNIFLOW_COORDINATOR_MAX_RUNS); "
        "more get RESOURCE_EXHAUSTED naming this limit; 0: no limit per tenant",
        minimum=0,
    )
    max_run_deadline_ms: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_RUN_DEADLINE_MS",
        3_600_000,
        "the longest deadline of a run, whatever the client or the workflow asks; a run "
        "that asks none gets this one; 0: no cap",
        minimum=0,
    )
    max_retry_backoff_ms: int = setting(
        "OMNIFLOW_COORDINATOR_MAX_RETRY_BACKOFF_MS",
        30_000,
        "the longest wait between two attempts of a node call, whatever its retry policy says",
        minimum=0,
    )
    record_retry_s: float = setting(
        "OMNIFLOW_COORDINATOR_RECORD_RETRY_S",
        5.0,
        "how long the final write of a run is retried before the run is reported failed "
        "(UNAVAILABLE) instead of finished unrecorded",
        minimum=0.0,
    )
    resume_orphans: bool = setting(
        "OMNIFLOW_COORDINATOR_RESUME_ORPHANS",
        True,
        "run a run whose coordinator died again from its recorded inputs (once) instead "
        "of failing it as interrupted",
    )
    node_timeout_s: float = setting(
        "OMNIFLOW_COORDINATOR_NODE_TIMEOUT_S",
        300.0,
        "deadline of a node call when neither the node nor the run sets one",
        minimum=0.001,
    )
    worker_wait_s: float = setting(
        "OMNIFLOW_COORDINATOR_WORKER_WAIT_S",
        30.0,
        "how long a node call waits (within its deadline) for a worker of its role that is "
        "restarting or loading (UNAVAILABLE, or no live worker of a role seen before), "
        "whatever the node's retry policy; 0: no wait",
        minimum=0.0,
    )
    pick_timeout_s: float = setting(
        "OMNIFLOW_COORDINATOR_PICK_TIMEOUT_S",
        2.0,
        "deadline of Pick calls to the router",
        minimum=0.001,
    )
