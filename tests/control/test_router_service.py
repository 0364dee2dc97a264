"""The router as a real process: proxy mode, retry-once, breakers, KV-aware picks from
the blocks echo TEST workers publish to the KV index, and the load-only fallback."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.kv.blocks import block_hashes
from omniflow.rpc.client import open_channel
from omniflow.values import from_python
from omniflow_services.worker.echo.engine import ECHO_LAYOUT

pytestmark = pytest.mark.integration

KV = router_pb2.STRATEGY_KV_AWARE


def _kv_pick(hashes: list[bytes], role: str = "llm", **extra: str) -> router_pb2.PickRequest:
    """A kv_aware pick of ``role`` for ``hashes`` of the echo workers' namespace."""
    return router_pb2.PickRequest(
        role=role,
        strategy=KV,
        kv_namespace=ECHO_LAYOUT.namespace_hex,
        block_hashes=hashes,
        **extra,
    )


async def generate(stub: worker_pb2_grpc.WorkerServiceStub, prompt: str) -> tuple[str, int]:
    text, cached = [], 0
    async for chunk in stub.Generate(worker_pb2.GenerateRequest(text=prompt)):
        text.append(chunk.text)
        cached = chunk.usage.cached_tokens or cached
    return "".join(text), cached


async def test_proxy_kv_aware_and_stats(cluster):
    procs = cluster(
        {"llm": 3},
        worker_env={"OMNIFLOW_ECHO_PUBLISH_KV": "1"},
        router_env={"OMNIFLOW_ROUTER_KV_INDEX": "redis"},
    )
    async with open_channel(procs["router"].address) as channel:
        proxy = worker_pb2_grpc.WorkerServiceStub(channel)
        router = router_pb2_grpc.RouterServiceStub(channel)
        assert (await generate(proxy, "hello there"))[0] == "echo: hello there"
        reply = await proxy.Invoke(
            worker_pb2.InvokeRequest(operation="upper", inputs={"text": from_python("abc")}),
            metadata=(("x-omniflow-role", "llm"),),
        )
        assert reply.outputs["text"].text == "ABC"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await proxy.Encode(worker_pb2.EncodeRequest())
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # no encoder role is live

        # KV-aware: the worker that served a prompt holds its blocks; the next turn of the
        # same conversation goes back to it, whatever the round-robin cursor says.
        prompt = "system: you are terse. user: tell me about paged attention please"
        hashes = block_hashes(ECHO_LAYOUT.namespace, list(prompt.encode()), ECHO_LAYOUT.page_size)
        first = await router.Pick(_kv_pick(hashes))
        assert first.reachable_blocks == 0 and first.fallback_reason == ""
        owner = first.worker
        async with open_channel(owner.address) as wch:
            _, cached = await generate(worker_pb2_grpc.WorkerServiceStub(wch), prompt)
        assert cached == 0
        await router.ReportOutcome(
            router_pb2.ReportOutcomeRequest(worker_id=owner.worker_id, success=True)
        )
        # The echo worker publishes its blocks to the index after its reply: wait for them
        # (each try a pick, its outcome reported, so the router's load stays level).
        tries = 0
        for _ in range(200):
            tries += 1
            probe = await router.Pick(_kv_pick(hashes))
            await router.ReportOutcome(
                router_pb2.ReportOutcomeRequest(worker_id=probe.worker.worker_id, success=True)
            )
            if probe.reachable_blocks == len(hashes):
                break
            await asyncio.sleep(0.05)
        for _ in range(4):
            again = await router.Pick(_kv_pick(hashes))
            assert again.worker.worker_id == owner.worker_id
            assert again.reachable_blocks == len(hashes) and again.cost == pytest.approx(0.0)
            await router.ReportOutcome(
                router_pb2.ReportOutcomeRequest(worker_id=owner.worker_id, success=True)
            )
        stats = await router.GetStats(router_pb2.GetStatsRequest())
        assert stats.counters["pick_kv_aware"] == 1 + tries + 4
        assert "kv_fallback_error" not in stats.counters
        assert set(stats.breakers.values()) == {"closed"}


async def test_breaker_opens_on_reported_failures_and_kv_falls_back_to_load(cluster):
    procs = cluster(
        {"llm": 2},
        router_env={"OMNIFLOW_ROUTER_KV_INDEX": "grpc", "OMNIFLOW_ROUTER_BREAKER_THRESHOLD": "2"},
    )
    async with open_channel(procs["router"].address) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        for _ in range(2):
            await router.ReportOutcome(
                router_pb2.ReportOutcomeRequest(
                    worker_id="llm-0", success=False, error_code="UNAVAILABLE"
                )
            )
        stats = await router.GetStats(router_pb2.GetStatsRequest())
        assert stats.breakers["llm-0"] == "open" and stats.counters["breaker_opened"] == 1
        picks = [
            (await router.Pick(router_pb2.PickRequest(role="llm"))).worker.worker_id
            for _ in range(4)
        ]
        assert picks == ["llm-1"] * 4
        # No kv-index is running: kv_aware answers by load, says so, and counts it.
        reply = await router.Pick(
            router_pb2.PickRequest(
                role="llm", strategy=KV, kv_namespace="00" * 16, block_hashes=[b"\x01" * 16]
            )
        )
        assert reply.fallback_reason.startswith("kv index failed (UNAVAILABLE)")
        stats = await router.GetStats(router_pb2.GetStatsRequest())
        assert stats.counters["kv_fallback_error"] == 1


async def test_proxy_retries_an_idempotent_call_once_on_another_worker(cluster):
    # No health polling: the dead worker stays a candidate until discovery drops it.
    procs = cluster(
        {"llm": 2},
        router_env={"OMNIFLOW_ROUTER_HEALTH_INTERVAL_S": "0"},
        worker_env={"OMNIFLOW_REGISTRATION_TTL_S": "30"},
    )
    procs["llm-0"].kill()
    async with open_channel(procs["router"].address) as channel:
        proxy = worker_pb2_grpc.WorkerServiceStub(channel)
        router = router_pb2_grpc.RouterServiceStub(channel)
        # Invoke first, while the dead worker's breaker is closed (it opens after 3
        # failures): Invoke is not idempotent unless the caller says so, so the one of two
        # round-robin picks that lands on the dead worker shows its error — no retry.
        codes = []
        for _ in range(2):
            try:
                await proxy.Invoke(
                    worker_pb2.InvokeRequest(operation="noop"),
                    metadata=(("x-omniflow-role", "llm"),),
                )
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
        assert sorted(codes) == ["OK", "UNAVAILABLE"]
        # Generate is idempotent: the next two picks cover both workers, so at least one
        # lands on the dead worker (a second failure, breaker still closed) and is retried
        # once on the other; every reply arrives.
        texts = [await generate(proxy, f"q{i}") for i in range(2)]
        assert [t for t, _ in texts] == [f"echo: q{i}" for i in range(2)]
        stats = await router.GetStats(router_pb2.GetStatsRequest())
        assert stats.counters["proxy_retries"] >= 1


async def test_kv_aware_counts_blocks_an_agent_acknowledged_before_the_index_knows(launch):
    # kv_stored_node: the caller knows that node's agent stored the blocks (an llm's
    # prefill_only reply), though the index has not announced them: the pick goes there.
    for node in ("n0", "n1"):
        launch("omniflow_services.worker", f"diffusion-{node}", OMNIFLOW_WORKER_ENGINE="echo",
               OMNIFLOW_WORKER_ROLE="diffusion", OMNIFLOW_NODE_ID=node).wait_ready()  # fmt: skip
    router_proc = launch("omniflow_services.router", "router", OMNIFLOW_ROUTER_KV_INDEX="off",
                         OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2").wait_ready()  # fmt: skip
    hashes = block_hashes(ECHO_LAYOUT.namespace, list(range(64)), 16)
    async with open_channel(router_proc.address) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)

        async def pick(node: str) -> str:
            reply = await router.Pick(_kv_pick(hashes, "diffusion", kv_stored_node=node))
            wid = reply.worker.worker_id
            await router.ReportOutcome(router_pb2.ReportOutcomeRequest(worker_id=wid, success=True))
            return wid

        assert [await pick(n) for n in ("n1", "n0", "n0", "n1", "n1", "n0")] == [
            f"diffusion-{n}" for n in ("n1", "n0", "n0", "n1", "n1", "n0")
        ]
        # Without it (and no index): by load alone, both workers get picks.
        assert {await pick("") for _ in range(12)} == {"diffusion-n0", "diffusion-n1"}


async def test_batched_outcomes_reach_the_router(cluster):
    """omniflow.outcomes, as the gateway and the coordinator report: successes wait for the
    batch, a failure goes at once; every outcome reaches the router's breakers."""
    from omniflow.outcomes import OutcomeReports

    procs = cluster({"llm": 2}, router_env={"OMNIFLOW_ROUTER_BREAKER_THRESHOLD": "3"})
    async with open_channel(procs["router"].address) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)

        async def stub() -> router_pb2_grpc.RouterServiceStub:
            return router

        reports = OutcomeReports(stub, timeout_s=5.0, interval_s=0.05)
        reports.add("llm-1", True, 3.0, urgent=False)
        for _ in range(3):
            reports.add("llm-0", False, 0.0, "UNAVAILABLE", urgent=True)
        await reports.close(wait_s=5.0)
        stats = await router.GetStats(router_pb2.GetStatsRequest())
        assert stats.breakers["llm-0"] == "open" and stats.breakers["llm-1"] != "open"
        picks = {(await router.Pick(router_pb2.PickRequest(role="llm"))).worker.worker_id}
        assert picks == {"llm-1"}


async def test_kv_aware_past_the_index_deadline_picks_by_load(cluster):
    # A kv-index that accepts the connection and never answers: the match outlives
    # OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S, and the pick is made by load, saying so.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        procs = cluster(
            {"llm": 2},
            router_env={
                "OMNIFLOW_ROUTER_KV_INDEX": "grpc",
                "OMNIFLOW_KV_INDEX_ADDR": f"127.0.0.1:{silent.getsockname()[1]}",
                "OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S": "0.2",
            },
        )
        async with open_channel(procs["router"].address) as channel:
            router = router_pb2_grpc.RouterServiceStub(channel)
            reply = await router.Pick(_kv_pick([b"\x01" * 16]), timeout=10)
            assert reply.worker.worker_id in {"llm-0", "llm-1"}
            assert reply.fallback_reason == "kv index timed out: load only"
            stats = await router.GetStats(router_pb2.GetStatsRequest())
            assert stats.counters["kv_fallback_timeout"] == 1
    finally:
        silent.close()
