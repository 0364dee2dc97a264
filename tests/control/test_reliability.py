"""Reliability of the control plane with real processes and a real Redis: a service that
is starting refuses its methods with UNAVAILABLE (health NOT_SERVING) until it serves;
a Redis that refuses writes is UNAVAILABLE, never INTERNAL; calls a client got wrong
never open a worker's breaker, through the router's proxy or reported by a caller."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis._parsers.base import BaseParser

from omniflow import errors
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.config import load_settings
from omniflow.localredis import RedisProcess
from omniflow.rpc.client import open_channel
from omniflow.rpc.server import Runtime, ServiceHost
from omniflow.rpc.status import domain_error
from omniflow.testing.launch import ServiceProc
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.server import WorkerApp

pytestmark = pytest.mark.integration


class SlowStart(WorkerApp):
    """A worker of the echo engine whose start (its "model load") waits for the test."""

    def __init__(self, settings: WorkerSettings, loaded: asyncio.Event) -> None:
        super().__init__(settings)
        self.loaded = loaded

    async def start(self, runtime: Runtime) -> None:
        await self.loaded.wait()
        await super().start(runtime)


async def _health(address: str) -> int:
    async with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def _generate(address: str) -> str:
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        req = worker_pb2.GenerateRequest(text="hello there")
        return "".join([c.text async for c in stub.Generate(req, timeout=5)])


async def test_a_starting_service_refuses_with_unavailable_until_serving(
    private_redis: RedisProcess,
) -> None:
    base = load_settings(WorkerSettings, env={"OMNIFLOW_WORKER_ENGINE": "echo"})
    settings = dataclasses.replace(
        base, redis_url=private_redis.url, port=0, metrics_port=-1, instance_id="slow-0"
    )
    loaded = asyncio.Event()
    host = ServiceHost(SlowStart(settings, loaded), settings)
    starting = asyncio.create_task(host.start())
    try:
        while not host.port:  # noqa: ASYNC110 - bound, serving health; the app "loading"
            await asyncio.sleep(0.01)
        address = f"127.0.0.1:{host.port}"
        for _ in range(50):  # the server starts right after the bind
            try:
                status = await _health(address)
                break
            except errors.Unavailable:
                await asyncio.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(errors.Unavailable) as refused:
            await _generate(address)
        assert "not SERVING" in str(refused.value)
        loaded.set()
        await starting
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
        assert await _generate(address) == "echo: hello there"
    finally:
        loaded.set()
        if not starting.done():
            await starting
        await host.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_redis_refusing_writes_is_unavailable(private_redis: RedisProcess) -> None:
    r = aioredis.from_url(private_redis.url)
    try:
        # A replica of a primary that is not there: it answers, and refuses every write.
        await r.execute_command("REPLICAOF", "127.0.0.1", str(_free_port()))
        with pytest.raises(Exception) as raised:
            await r.set("k", "v")
        mapped = domain_error(raised.value)
        assert isinstance(mapped, errors.Unavailable), repr(raised.value)
        await r.execute_command("REPLICAOF", "NO", "ONE")
        assert await r.set("k", "v")
    finally:
        await r.aclose()
    # MISCONF (its last save failed: a full disk) as redis-py itself parses the reply.
    misconf = BaseParser.parse_error(
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
        "persist to disk."
    )
    assert isinstance(domain_error(misconf), errors.Unavailable)
    wrong = BaseParser.parse_error("WRONGTYPE Operation against a key holding the wrong kind")
    assert domain_error(wrong) is None  # a bug stays INTERNAL


async def _breakers(router: str) -> dict[str, str]:
    async with open_channel(router) as channel:
        stats = await router_pb2_grpc.RouterServiceStub(channel).GetStats(
            router_pb2.GetStatsRequest(), timeout=5
        )
    return dict(stats.breakers)


async def test_caller_errors_never_open_a_breaker(
    cluster: Callable[..., dict[str, ServiceProc]],
) -> None:
    procs = cluster({"llm": 2}, router_env={"OMNIFLOW_ROUTER_BREAKER_THRESHOLD": "3"})
    router = procs["router"].address
    llm = (("x-omniflow-role", "llm"),)
    async with open_channel(router) as channel:
        proxy = worker_pb2_grpc.WorkerServiceStub(channel)
        rstub = router_pb2_grpc.RouterServiceStub(channel)
        for _ in range(6):
            with pytest.raises(errors.FailedPrecondition):  # another role's method
                await proxy.GenerateImage(
                    worker_pb2.GenerateImageRequest(), metadata=llm, timeout=5
                )
            with pytest.raises(errors.InvalidArgument):  # a request it refuses: no prompt
                empty = worker_pb2.GenerateRequest()
                [c async for c in proxy.Generate(empty, metadata=llm, timeout=5)]
            with pytest.raises(errors.NotFound):  # an operation it does not know
                await proxy.Invoke(
                    worker_pb2.InvokeRequest(operation="nope"), metadata=llm, timeout=5
                )
        workers = [
            w.worker_id for w in (await rstub.ListWorkers(router_pb2.ListWorkersRequest())).workers
        ]
        # Outcomes reported by a caller (as the gateway and coordinator do), by code.
        outcomes = [
            router_pb2.ReportOutcomeRequest(worker_id=w, success=False, error_code=code)
            for w in workers
            for code in ("INVALID_ARGUMENT", "UNIMPLEMENTED", "PERMISSION_DENIED") * 2
        ]
        await rstub.ReportOutcomes(router_pb2.ReportOutcomesRequest(outcomes=outcomes))
        assert set((await _breakers(router)).values()) == {"closed"}
        # The control: worker faults do open it (threshold 3).
        faults = [
            router_pb2.ReportOutcomeRequest(
                worker_id=workers[0], success=False, error_code="UNAVAILABLE"
            )
        ] * 3
        await rstub.ReportOutcomes(router_pb2.ReportOutcomesRequest(outcomes=faults))
        assert (await _breakers(router))[workers[0]] == "open"


async def test_the_coordinator_does_not_tokenize_a_prompt_past_its_bound() -> None:
    from omniflow_services.coordinator.kvhints import NO_WORKERS, TOO_LARGE, KVHinter

    listed: list[str] = []

    async def workers() -> list:
        listed.append("asked")  # the first step of hinting: finding the model's workers
        return []

    hinter = KVHinter(workers, max_prompt_bytes=1000)
    assert await hinter.hints("llm", "é" * 600) is None  # 1200 bytes of UTF-8
    assert hinter.counts[TOO_LARGE] == 1 and not listed  # refused before any work
    assert await hinter.hints("llm", "short") is None
    assert hinter.counts[NO_WORKERS] == 1 and listed  # the control: a small one goes on


async def test_run_deadlines_and_retry_backoff_are_capped(
    cluster: Callable[..., dict[str, ServiceProc]],
) -> None:
    from omniflow.client import Client
    from omniflow.dsl import Retry, VType, Workflow, register_operation

    register_operation(
        "echo", "sleep", {"ms": VType.INT}, {"slept_ms": VType.FLOAT, "worker": VType.TEXT}
    )
    register_operation("echo", "fail", {"text": VType.TEXT}, {"text": VType.TEXT})
    procs = cluster(
        {"echo": 2},  # a retried call goes to the other worker
        coordinator_env={
            "OMNIFLOW_COORDINATOR_MAX_RUN_DEADLINE_MS": "1500",
            "OMNIFLOW_COORDINATOR_MAX_RETRY_BACKOFF_MS": "100",
        },
    )
    # A run that asks no deadline (and a workflow that asks an hour) gets the cap.
    slow = Workflow("slow-cap", deadline_ms=3_600_000)
    slow.output("w", slow.call("nap", "echo", "sleep", ms=slow.input("ms", VType.INT))["worker"])
    # A retry policy asking an hour between attempts waits the cap.
    parked = Workflow("parked-cap")
    node = parked.call(
        "f", "echo", "fail", text=parked.input("t", VType.TEXT),
        retry=Retry(max_attempts=2, initial_backoff_ms=3_600_000),
    )  # fmt: skip
    parked.output("t", node["text"])
    async with Client(procs["coordinator"].address) as client:
        await client.register(slow)
        await client.register(parked)
        ended = await client.run("slow-cap", {"ms": 20_000})
        assert not ended.ok and "deadline of 1500 ms exceeded" in ended.error, ended.error
        started = time.monotonic()
        ended = await client.run("parked-cap", {"t": "x"})
        took = time.monotonic() - started
        assert not ended.ok and "UNAVAILABLE" in ended.error, ended.error
        assert "after 2 attempts" in ended.error, ended.error
    assert took < 60  # a wait of the 100 ms cap, not of an hour (generous: shared CPUs)


async def test_a_run_waits_for_its_lone_router_to_restart(
    cluster: Callable[..., dict[str, ServiceProc]], launch: Callable[..., ServiceProc]
) -> None:
    from omniflow.client import Client
    from omniflow.dsl import VType, Workflow

    procs = cluster({"llm": 1})
    router = procs["router"]
    wf = Workflow("lone-router")  # no retry policy: only the wait can save it
    wf.output("t", wf.call("say", "llm", "generate", prompt=wf.input("p", VType.TEXT))["text"])
    async with Client(procs["coordinator"].address) as client:
        await client.register(wf)
        router.kill()
        run = asyncio.create_task(client.run("lone-router", {"p": "still here"}))
        await asyncio.sleep(1.5)  # what the supervisor does: the same port, a new process
        port = router.address.rsplit(":", 1)[1]
        launch(
            "omniflow_services.router",
            "router-again",
            OMNIFLOW_PORT=port,
            OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2",
        ).wait_ready()
        result = await run
    assert result.ok, result.error
    assert result.outputs["t"] == "echo: still here"
