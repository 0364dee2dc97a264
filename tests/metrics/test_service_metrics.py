"""Every service's Prometheus series after a workflow run: real processes (kv-index, two
kv-agents, an llm worker on tiny qwen2, router, coordinator) on a private Redis, each
serving /metrics on its own port; after two runs of one kv_aware workflow with the same
prompt and a page pull between the agents, the named series exist and moved."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.client import Client
from omniflow.dsl import VType, Workflow
from omniflow.kv.blocks import block_hashes
from omniflow.models.resolve import resolve_model
from omniflow.rpc.client import open_channel
from omniflow.testing.launch import ServiceProc

pytestmark = pytest.mark.integration

SHM = Path("/dev/shm")
PROMPT = " ".join(f"page{i} holds keys and values of layer {i % 7}" for i in range(16))

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(proc: ServiceProc) -> Series:
    """``{(sample name, sorted labels): value}`` of one service's /metrics."""
    port = proc.info["metrics_port"]
    assert port, f"{proc.name} serves no metrics: {proc.info}"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(series: Series, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``; raises when
    no sample of that name (and labels) is exported at all."""
    found = [
        v
        for (n, lab), v in series.items()
        if n == name and all((k, want) in lab for k, want in labels.items())
    ]
    assert found, f"no series {name}{labels or ''}; exported: {sorted({n for n, _ in series})}"
    return sum(found)


async def _pull(address: str, source: str, namespace: str, hashes: list[bytes]) -> int:
    async with open_channel(address) as channel:
        stub = kvagent_pb2_grpc.KVAgentServiceStub(channel)
        reply = await stub.PullPages(
            kvagent_pb2.PullPagesRequest(
                namespace=namespace, block_hashes=hashes, source_address=source, channel="grpc"
            ),
            timeout=30,
        )
    return reply.pulled


async def _namespace_known(index: str, namespace: str) -> None:
    """Until the index knows ``namespace`` (else a match is NOT_FOUND)."""
    async with open_channel(index) as channel:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        for _ in range(300):
            try:
                await stub.GetNamespace(kvindex_pb2.GetNamespaceRequest(namespace=namespace))
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            await asyncio.sleep(0.1)
    raise AssertionError(f"the worker never registered namespace {namespace}")


async def _held_by_agent(index: str, namespace: str, hashes: list[bytes]) -> None:
    """Until the index shows an agent (the node's host tier) holding the prompt's pages."""
    async with open_channel(index) as channel:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        for _ in range(300):
            reply = await stub.MatchPrefix(
                kvindex_pb2.MatchPrefixRequest(namespace=namespace, block_hashes=hashes)
            )
            if any(
                o.kind == kvindex_pb2.OWNER_KIND_AGENT and o.matched_blocks == len(hashes)
                for o in reply.owners
            ):
                return
            await asyncio.sleep(0.1)
    raise AssertionError("the node's agent never held the prompt's pages")


async def test_every_service_exports_its_series_after_a_run(
    launch: Callable[..., ServiceProc], tmp_path: Path
):
    tag = uuid.uuid4().hex[:8]
    models = tmp_path / "models"
    resolve_model("tiny:qwen2", models)
    metrics = {"OMNIFLOW_METRICS_PORT": "0"}
    try:
        index = launch("omniflow_services.kv_index", "kv-index", **metrics).wait_ready()
        agents = {
            node: launch(
                "omniflow_services.kv_agent",
                f"kva-{node}-{tag}",
                OMNIFLOW_NODE_ID=f"node-{node}",
                OMNIFLOW_KV_INDEX_ADDR=index.address,
                OMNIFLOW_KV_HOST_BYTES=str(16 * 1024 * 1024),
                **metrics,
            ).wait_ready()
            for node in ("a", "b")
        }
        worker = launch(
            "omniflow_services.worker",
            "llm-a",
            OMNIFLOW_WORKER_ROLE="llm",
            OMNIFLOW_WORKER_MODEL="tiny:qwen2",
            OMNIFLOW_MODELS_DIR=str(models),
            OMNIFLOW_NODE_ID="node-a",
            OMNIFLOW_WORKER_KV_BYTES=str(16 * 1024 * 1024),
            **metrics,
        ).wait_ready(timeout_s=180)
        router = launch(
            "omniflow_services.router",
            "router",
            OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2",
            OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S="5",
            **metrics,
        ).wait_ready()
        coordinator = launch(
            "omniflow_services.coordinator",
            "coordinator",
            OMNIFLOW_ROUTER_ADDR=router.address,
            **metrics,
        ).wait_ready()

        namespace = worker.info["metadata"]["kv_namespace"]

        wf = Workflow("watched")
        gen = wf.call(
            "gen",
            "llm",
            "generate",
            prompt=wf.input("prompt", VType.TEXT),
            params={"max_tokens": 4, "temperature": 0.0},
            strategy="kv_aware",
        )
        wf.output("text", gen["text"])
        async with Client(coordinator.address) as client:
            await client.register(wf)
            first = await client.run("watched", {"prompt": PROMPT})
            assert first.ok, first.error
            # The index learns the namespace with the worker's first pages: until then a
            # kv_aware pick finds it unknown and picks by load.
            await _namespace_known(index.address, namespace)
            errors_before = value(
                scrape(router), "omniflow_router_kv_fallbacks_total", reason="error"
            )
            second = await client.run("watched", {"prompt": PROMPT})  # its prefix is cached
            assert second.ok, second.error
        folder = Path(worker.info["metadata"]["model"])
        ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
        hashes = block_hashes(bytes.fromhex(namespace), ids, 16)
        assert len(hashes) >= 4
        await _held_by_agent(index.address, namespace, hashes)
        pulled = await _pull(agents["b"].address, agents["a"].address, namespace, hashes)
        assert pulled == len(hashes)
        for _ in range(150):  # the index refreshes its size gauges every second
            i = scrape(index)
            if value(i, "omniflow_kv_index_owners") >= 3 and value(
                i, "omniflow_kv_index_blocks", tier="device"
            ) >= len(hashes):
                break
            await asyncio.sleep(0.1)

        w = scrape(worker)
        assert value(w, "omniflow_worker_time_to_first_token_seconds_count") >= 2
        assert value(w, "omniflow_worker_inter_token_latency_seconds_count") >= 2 * 3
        assert value(w, "omniflow_worker_request_latency_seconds_count") >= 2
        assert value(w, "omniflow_worker_requests_total", finish_reason="length") >= 2
        assert value(w, "omniflow_worker_requests_running") == 0
        assert value(w, "omniflow_worker_requests_waiting") == 0
        assert value(w, "omniflow_worker_kv_pages_capacity") > 0
        # Nothing runs: every page is free or cached and evictable.
        assert value(w, "omniflow_worker_kv_pages_used") == 0
        prompt_tokens = value(w, "omniflow_worker_prompt_tokens_total")
        hits = value(w, "omniflow_worker_prefix_cache_hit_tokens_total")
        assert prompt_tokens >= 2 * 16 * len(hashes)
        assert value(w, "omniflow_worker_prefix_cache_hit_tokens_total", source="device") > 0
        assert 0 < hits < prompt_tokens
        assert value(w, "omniflow_worker_generated_tokens_total") >= 2 * 4
        assert value(w, "omniflow_worker_preemptions_total") == 0
        assert value(w, "omniflow_rpc_served_total", code="OK") > 0

        r = scrape(router)
        assert value(r, "omniflow_router_picks_total", strategy="kv_aware", worker="llm-a") >= 2
        assert value(r, "omniflow_router_pick_seconds_count", strategy="kv_aware") >= 2
        assert value(r, "omniflow_router_breaker_state", worker="llm-a", state="closed") == 1
        assert value(r, "omniflow_router_breaker_state", worker="llm-a", state="open") == 0
        fallbacks = {k: v for k, v in r.items() if k[0] == "omniflow_router_kv_fallbacks_total"}
        # Only the first run's picks (a namespace the index did not know yet: NOT_FOUND, and
        # any retry of that run) may fall back; once the index knows it, none does.
        errors = value(r, "omniflow_router_kv_fallbacks_total", reason="error")
        assert errors == errors_before, fallbacks
        assert value(r, "omniflow_router_kv_fallbacks_total", reason="timeout") == 0, fallbacks
        assert value(r, "omniflow_router_workers", role="llm") == 1

        a, b = scrape(agents["a"]), scrape(agents["b"])
        page_count = len(hashes)
        assert value(a, "omniflow_kv_agent_pages", tier="host") >= page_count
        assert value(a, "omniflow_kv_agent_stored_bytes", tier="host") > 0
        assert value(a, "omniflow_kv_agent_capacity_pages", tier="host") > 0
        assert value(a, "omniflow_kv_agent_transfer_pages_total", direction="out") >= page_count
        assert value(
            b, "omniflow_kv_agent_transfer_pages_total", channel="grpc", direction="in"
        ) == (page_count)
        assert value(b, "omniflow_kv_agent_transfer_bytes_total", channel="grpc") > 0
        assert value(b, "omniflow_kv_agent_pages", tier="host") == page_count
        assert value(a, "omniflow_kv_agent_lookups_total", result="host_hit") >= page_count
        for name in ("checksum_failures", "evictions", "demotions", "promotions"):
            assert value(a, f"omniflow_kv_agent_{name}_total") == 0

        i = scrape(index)
        assert value(i, "omniflow_kv_index_events_total", kind="stored") >= 2 * page_count
        assert value(i, "omniflow_kv_index_batches_total", outcome="accepted") > 0
        assert value(i, "omniflow_kv_index_owners") >= 3  # two agents and the worker
        blocks = {k: v for k, v in i.items() if k[0] == "omniflow_kv_index_blocks"}
        assert value(i, "omniflow_kv_index_blocks", tier="device") >= page_count, blocks
        assert value(i, "omniflow_kv_index_match_prefix_seconds_count") >= 2
        assert value(i, "omniflow_kv_index_match_prefix_blocks_total", result="held") > 0
        assert value(i, "omniflow_kv_index_snapshots_total") >= 1

        c = scrape(coordinator)
        assert value(c, "omniflow_coordinator_runs_total", state="started") == 2
        assert value(c, "omniflow_coordinator_runs_total", state="succeeded") == 2
        assert value(c, "omniflow_coordinator_runs_in_flight") == 0
        assert (
            value(
                c,
                "omniflow_coordinator_node_seconds_count",
                role="llm",
                operation="generate",
                outcome="OK",
            )
            == 2
        )
    finally:
        _remove_shm(tag)


def _remove_shm(tag: str) -> None:
    """The agents' host-tier files (they remove them on SIGTERM; this covers a crash)."""
    for path in SHM.glob(f"omniflow-*{tag}*"):
        path.unlink(missing_ok=True)
