"""The worker's Prometheus series: request latencies from the Generate path, and the
engine's queues, KV pool and counters read at scrape time.

The names follow what vLLM and SGLang users look for (time to first token, inter-token
latency, end-to-end latency, running/waiting requests, KV usage, prefix-cache hit rate,
preemptions), under ``omniflow_worker_``. The hit rate is
``rate(omniflow_worker_prefix_cache_hit_tokens_total) / rate(omniflow_worker_prompt_tokens_total)``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram

from omniflow import telemetry
from omniflow.telemetry import Sample
from omniflow_services.worker.llm.types import EngineStats, RequestOutput

if TYPE_CHECKING:
    from omniflow_services.worker.core import WorkerCore

# From a few milliseconds (a tiny model on a GPU) to minutes (a long prompt on a CPU).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0, 300.0)  # fmt: skip

TTFT = Histogram(
    "omniflow_worker_time_to_first_token_seconds",
    "Time from a Generate call to its first output token",
    buckets=_TTFT_BUCKETS,
)
ITL = Histogram(
    "omniflow_worker_inter_token_latency_seconds",
    "Time between two output tokens of one request (a step's gap shared by its tokens)",
    buckets=_ITL_BUCKETS,
)
E2E = Histogram(
    "omniflow_worker_request_latency_seconds",
    "Time from a Generate call to its last output (end to end, in the worker)",
    buckets=_E2E_BUCKETS,
)
FINISHED = Counter(
    "omniflow_worker_requests_total",
    "Generate requests ended, by finish reason (stop, length, abort; cancelled: the caller left)",
    ["finish_reason"],
)
PREFILL_STORE_INCOMPLETE = Counter(
    "omniflow_worker_prefill_store_incomplete",
    "prefill_only replies sent before the agent acknowledged all their full pages "
    "(timeout, a dropped or failed store, or no agent attached)",
)


def timed(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """``stream`` as is, timing its outputs; the clock starts now (at the call)."""
    return _timed(stream, time.perf_counter())


async def _timed(
    stream: AsyncIterator[RequestOutput], started: float
) -> AsyncIterator[RequestOutput]:
    last: float | None = None
    reason = "cancelled"
    try:
        async for out in stream:
            now = time.perf_counter()
            n = len(out.new_token_ids)
            if n and last is None:
                TTFT.observe(now - started)
            elif n and last is not None:
                gap = (now - last) / n
                for _ in range(n):
                    ITL.observe(gap)
            if n:
                last = now
            if out.finished:
                reason = out.finish_reason or "stop"
            yield out
    finally:
        E2E.observe(time.perf_counter() - started)
        FINISHED.labels(reason).inc()
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:  # the engine aborts the request now, not when collected
            await aclose()


def watch(core: WorkerCore) -> Callable[[], None]:
    """Export ``core``'s engine on every scrape; returns the function that stops it."""
    return telemetry.add_sampler(lambda: _engine_samples(core))


def _engine_samples(core: WorkerCore) -> Iterator[Sample]:
    llm = core.llm
    if llm is None:
        return
    engine = llm.engine
    load = engine.load()
    yield Sample("omniflow_worker_requests_running", "Requests in the running batch", load.running)
    yield Sample("omniflow_worker_requests_waiting", "Requests queued for admission", load.waiting)
    yield Sample(
        "omniflow_worker_kv_pages_used",
        "Pages of the device KV pool in use (by requests or the prefix cache)",
        load.total_pages - load.free_pages,
    )
    yield Sample(
        "omniflow_worker_kv_pages_capacity", "Pages in the device KV pool", load.total_pages
    )
    stats = getattr(engine, "stats", None)
    if not isinstance(stats, EngineStats):  # a backend with no counters of its own
        return
    yield from (
        Sample(name, doc, value, labels, counter=True)
        for name, doc, value, labels in (
            (
                "omniflow_worker_prompt_tokens_total",
                "Prompt tokens of admitted requests",
                stats.prompt_tokens,
                (),
            ),
            (
                "omniflow_worker_prefix_cache_hit_tokens_total",
                "Prompt tokens served from cached KV: the device pool or the node's agent",
                stats.device_hit_tokens,
                (("source", "device"),),
            ),
            (
                "omniflow_worker_prefix_cache_hit_tokens_total",
                "",
                stats.connector_hit_tokens,
                (("source", "agent"),),
            ),
            (
                "omniflow_worker_generated_tokens_total",
                "Output tokens sampled",
                stats.generated_tokens,
                (),
            ),
            (
                "omniflow_worker_preemptions_total",
                "Running requests preempted to free KV pages (recomputed later)",
                stats.preemptions,
                (),
            ),
            ("omniflow_worker_engine_steps_total", "Engine steps run", stats.steps, ()),
            (
                "omniflow_worker_batched_tokens_total",
                "Tokens computed in engine steps (prefill and decode)",
                stats.batched_tokens,
                (),
            ),
            (
                "omniflow_worker_kv_connector_failures_total",
                "KV fetches or stores through the agent that failed (the pages were recomputed)",
                stats.connector_failures,
                (),
            ),
        )
    )
    grammars = getattr(engine, "grammars", None)
    doc = "Structured-output requests by how their constraint was served (compiled, cached, failed)"
    for result, count in grammars.counts.items() if grammars is not None else ():
        yield Sample(
            "omniflow_worker_grammar_compiles_total", doc, count, (("result", result),), True
        )
        doc = ""  # the help text once per series
