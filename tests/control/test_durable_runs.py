"""Durable state: run records and workflow versions survive a Redis restart (AOF); a run
whose final record cannot be written is reported FAILED with an UNAVAILABLE reason, never
SUCCEEDED unrecorded; Redis down reaches clients as UNAVAILABLE, never INTERNAL. Real
router, coordinator, kv-index and echo TEST worker processes on a Redis of the test's own
(with a password, as `omniflow up` starts it)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.client import Client
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.errors import Unavailable
from omniflow.localredis import (
    RedisProcess,
    spawn_redis,
    start_redis,
    wait_redis,
)
from omniflow.rpc.client import open_channel

pytestmark = pytest.mark.integration

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})
register_operation(
    "echo", "sleep", {"ms": VType.INT}, {"slept_ms": VType.FLOAT, "worker": VType.TEXT}
)
PASSWORD = "t3st-only-password"


@pytest.fixture
def durable_redis(tmp_path: Path, redis_binary: Path):
    """A persistent (AOF everysec) Redis with a password, restartable on the same dir."""
    server = start_redis(dir=tmp_path / "aof", persist=True, password=PASSWORD, binary=redis_binary)
    box: dict[str, object] = {"server": server, "restarted": []}
    yield box
    for popen in box["restarted"]:  # type: ignore[attr-defined]
        if popen.poll() is None:
            popen.kill()
        popen.wait()
    server.stop()


def _kill(server: RedisProcess) -> None:
    server._proc.send_signal(signal.SIGKILL)
    server._proc.wait()


def _restart(box: dict) -> None:
    """The same command line on the same port and dir: Redis loads its AOF back."""
    server: RedisProcess = box["server"]
    popen = spawn_redis(server.argv, server.dir, PASSWORD)
    box["restarted"].append(popen)
    assert wait_redis(server.port, popen.pid, 20.0, PASSWORD, popen.poll), "redis restart"


def _start(launch, url: str, coordinator_env: dict[str, str] | None = None) -> dict:
    worker = launch("omniflow_services.worker", "echo-0", OMNIFLOW_WORKER_ENGINE="echo",
                    OMNIFLOW_REDIS_URL=url, OMNIFLOW_WORKER_ROLE="echo").wait_ready()  # fmt: skip
    router = launch("omniflow_services.router", "router", OMNIFLOW_REDIS_URL=url).wait_ready()
    coord = launch(
        "omniflow_services.coordinator",
        "coordinator",
        OMNIFLOW_REDIS_URL=url,
        OMNIFLOW_ROUTER_ADDR=router.address,
        **(coordinator_env or {}),
    ).wait_ready()
    return {"worker": worker, "router": router, "coordinator": coord}


def _shout() -> Workflow:
    wf = Workflow("shout")
    text = wf.input("text", VType.TEXT)
    wf.output("text", wf.call("up", "echo", "upper", text=text)["text"])
    return wf


def _slow() -> Workflow:
    wf = Workflow("slow")
    ms = wf.input("ms", VType.INT)
    wf.output("slept_ms", wf.call("nap", "echo", "sleep", ms=ms)["slept_ms"])
    return wf


async def test_runs_and_workflows_survive_a_redis_restart(launch, durable_redis) -> None:
    server: RedisProcess = durable_redis["server"]
    procs = _start(launch, server.url)
    async with Client(procs["coordinator"].address) as client:
        version = await client.register(_shout())
        result = await client.run("shout", {"text": "kept"})
        assert result.ok and result.outputs == {"text": "KEPT"}

        _kill(server)
        _restart(durable_redis)

        run = await client.get_run(result.run_id)  # not live any more: read from Redis
        assert run.state == cpb.RUN_STATE_SUCCEEDED
        assert run.outputs["text"].text == "KEPT"
        events = [ev async for ev in client.events(result.run_id)]
        assert events[-1].run_finished.state == cpb.RUN_STATE_SUCCEEDED
        assert [w.name for w in await client.list_workflows()] == ["shout"]
        graph = await client.get_workflow("shout")
        assert graph.version == version
        again = await client.run("shout", {"text": "again"})  # and it still runs
        assert again.ok and again.outputs == {"text": "AGAIN"}
    # The password is not in any service's log.
    for proc in procs.values():
        assert PASSWORD not in proc.tail(), proc.name


async def test_unrecorded_run_fails_unavailable_and_redis_down_is_unavailable(
    launch, durable_redis
) -> None:
    server: RedisProcess = durable_redis["server"]
    procs = _start(launch, server.url, {"OMNIFLOW_COORDINATOR_RECORD_RETRY_S": "1"})
    async with Client(procs["coordinator"].address) as client:
        await client.register(_slow())
        run_id = await client.submit("slow", {"ms": 1500})
        await asyncio.sleep(0.3)
        _kill(server)  # the run ends while Redis is gone
        events = [ev async for ev in client.events(run_id)]
        fin = events[-1].run_finished
        assert fin.state == cpb.RUN_STATE_FAILED, fin
        assert fin.error.startswith("UNAVAILABLE:") and "record" in fin.error, fin.error
        assert (await client.get_run(run_id)).state == cpb.RUN_STATE_FAILED

        # Redis down: UNAVAILABLE from the coordinator, never INTERNAL.
        with pytest.raises(Unavailable):
            await client.list_workflows()
        with pytest.raises(Unavailable):
            await client.get_run("no-such-run")
        # The router's index path: a kv_aware pick still lands, by load, and says why.
        async with open_channel(procs["router"].address) as channel:
            pick = await router_pb2_grpc.RouterServiceStub(channel).Pick(
                router_pb2.PickRequest(
                    role="echo",
                    strategy=router_pb2.STRATEGY_KV_AWARE,
                    kv_namespace="ab" * 16,
                    block_hashes=[b"\x01" * 16, b"\x02" * 16],
                )
            )
        assert pick.worker.worker_id == "echo-0"
        # ("failed (UNAVAILABLE)" or "timed out": the router's Redis client retries first)
        assert pick.fallback_reason.startswith("kv index "), pick.fallback_reason

        _restart(durable_redis)
        db = aioredis.from_url(server.url)
        try:
            end = time.monotonic() + 10
            stored = None
            while time.monotonic() < end:
                stored = await db.get(f"omniflow:run:{run_id}")
                if stored is not None:
                    run = cpb.Run()
                    run.ParseFromString(stored)
                    if run.state == cpb.RUN_STATE_FAILED:
                        break
                await asyncio.sleep(0.1)
            assert stored is not None, "the failed record was never written"
            assert run.state == cpb.RUN_STATE_FAILED and run.error.startswith("UNAVAILABLE:")
            assert not await db.hexists("omniflow:runs:active", run_id)
        finally:
            await db.aclose()


async def test_kv_index_answers_unavailable_while_redis_is_down(launch, durable_redis) -> None:
    server: RedisProcess = durable_redis["server"]
    index = launch("omniflow_services.kv_index", "kv-index", OMNIFLOW_REDIS_URL=server.url)
    index.wait_ready()
    _kill(server)
    async with open_channel(index.address, default_timeout_s=10.0) as channel:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        calls = [
            stub.MatchPrefix(kvindex_pb2.MatchPrefixRequest(namespace="00" * 16,
                                                            block_hashes=[b"\x01" * 16])),
            stub.Stats(kvindex_pb2.StatsRequest()),
        ]  # fmt: skip
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert PASSWORD not in index.tail()
