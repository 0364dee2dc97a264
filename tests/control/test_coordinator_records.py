"""What the coordinator's cheaper hot path must keep: the run record and every event are in
Redis before a client sees RunFinished; the active entry exists once SubmitRun returns; a
cached graph never hides a newer version. Real router, coordinator and echo TEST worker
processes on a private Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.client import Client
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.localredis import RedisProcess
from omniflow.rpc.client import open_channel
from omniflow_services.coordinator.live import LiveRun
from omniflow_services.coordinator.runs import RunManager

pytestmark = pytest.mark.integration

register_operation("echo", "noop", {"text": VType.TEXT}, {"text": VType.TEXT})
register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})
register_operation(
    "echo", "sleep", {"ms": VType.INT}, {"slept_ms": VType.FLOAT, "worker": VType.TEXT}
)


async def picks_made(router: str) -> int:
    async with open_channel(router) as channel:
        stats = await router_pb2_grpc.RouterServiceStub(channel).GetStats(
            router_pb2.GetStatsRequest()
        )
    return sum(n for name, n in stats.counters.items() if name.startswith("pick_"))


def chain(name: str, op: str, hops: int) -> Workflow:
    wf = Workflow(name)
    value = wf.input("text", VType.TEXT)
    for i in range(hops):
        value = wf.call(f"n{i}", "echo", op, text=value)["text"]
    wf.output("text", value)
    return wf


async def test_run_is_recorded_before_run_finished_is_seen(cluster, redis_proc: RedisProcess):
    procs = cluster({"echo": 1})
    db = aioredis.from_url(redis_proc.url)
    try:
        async with Client(procs["coordinator"].address) as client:
            await client.register(chain("recorded", "noop", 4))
            for _ in range(20):
                seen = []
                async for ev in client.stream("recorded", {"text": "x"}):
                    seen.append(ev)
                    if ev.HasField("run_finished"):
                        break
                run_id = seen[-1].run_id
                # Read Redis directly, at once: no waiting for a background flush.
                raw = await db.get(f"omniflow:run:{run_id}")
                assert raw is not None
                run = cpb.Run.FromString(raw)
                assert run.state == cpb.RUN_STATE_SUCCEEDED
                assert [n.state for n in run.nodes] == [cpb.RUN_STATE_SUCCEEDED] * 4
                stored = await db.lrange(f"omniflow:run:{run_id}:events", 0, -1)
                assert [cpb.RunEvent.FromString(e) for e in stored] == seen
                assert not await db.hexists("omniflow:runs:active", run_id)
                assert await db.ttl(f"omniflow:run:{run_id}") > 0

            # SubmitRun returns once the run is in the active set (or already finished).
            run_id = await client.submit("recorded", {"text": "y"})
            active = await db.hexists("omniflow:runs:active", run_id)
            assert active or await db.exists(f"omniflow:run:{run_id}")
    finally:
        await db.aclose()


async def test_latest_version_is_never_hidden_by_the_graph_cache(cluster):
    procs = cluster({"echo": 1})
    async with Client(procs["coordinator"].address) as client:
        assert await client.register(chain("versions", "noop", 2)) == 1
        first = await client.run("versions", {"text": "abc"})
        assert first.outputs == {"text": "abc"}
        assert await client.register(chain("versions", "upper", 2)) == 2
        second = await client.run("versions", {"text": "abc"})
        assert second.outputs == {"text": "ABC"}
        pinned = await client.run("versions", {"text": "abc"}, version=1)
        assert pinned.outputs == {"text": "abc"}


async def test_a_large_flush_and_the_final_one(redis_server: RedisProcess):
    """Thousands of events in one flush (the write script appends them in slices), then
    the final write: RunFinished last, both keys expiring, the run out of the active set."""
    db = aioredis.from_url(redis_server.url)
    run_id = uuid.uuid4().hex
    key = f"omniflow:run:{run_id}"
    try:
        manager = RunManager(db, caller=None, owner_id="test", run_ttl_s=60)  # type: ignore[arg-type]
        live = LiveRun(cpb.Run(run_id=run_id, state=cpb.RUN_STATE_RUNNING))
        await db.hset("omniflow:runs:active", run_id, "test")
        for i in range(5000):
            live.emit(node_started=cpb.NodeStarted(node=f"each[{i}]/n"))
        await manager._flush(live)
        assert await db.llen(f"{key}:events") == 5000 and await db.ttl(key) == -1
        live.run.state = cpb.RUN_STATE_SUCCEEDED
        finished = live.event(run_finished=cpb.RunFinished(state=cpb.RUN_STATE_SUCCEEDED))
        await manager._flush(live, finished)
        stored = await db.lrange(f"{key}:events", -2, -1)
        assert [cpb.RunEvent.FromString(e).seq for e in stored] == [5000, 5001]
        assert cpb.RunEvent.FromString(stored[-1]).HasField("run_finished")
        assert cpb.Run.FromString(await db.get(key)).state == cpb.RUN_STATE_SUCCEEDED
        assert 0 < await db.ttl(key) <= 60 and 0 < await db.ttl(f"{key}:events") <= 60
        assert not await db.hexists("omniflow:runs:active", run_id)
    finally:
        await db.delete(key, f"{key}:events")
        await db.hdel("omniflow:runs:active", run_id)
        await db.aclose()


async def test_no_pick_ahead_behind_a_slow_producer(cluster):
    """A pick made while a slow producer runs would be stale when used (and made again):
    once the coordinator has seen the producer take longer than that, its consumers pick
    when their inputs arrive, one Pick per call."""
    procs = cluster({"echo": 1})
    wf = Workflow("slow_then_fast")
    nap = wf.call("nap", "echo", "sleep", ms=300)
    wf.output("text", wf.call("after", "echo", "noop", text=nap["worker"])["text"])
    async with Client(procs["coordinator"].address) as client:
        await client.register(wf)
        before = await picks_made(procs["router"].address)
        assert (await client.run("slow_then_fast", {})).ok
        first = await picks_made(procs["router"].address) - before
        assert first == 3  # 'after' picked ahead, too early: released and picked again
        for _ in range(2):
            before = await picks_made(procs["router"].address)
            assert (await client.run("slow_then_fast", {})).outputs == {"text": "echo-0"}
            assert await picks_made(procs["router"].address) - before == 2


async def test_a_periodic_flush_queued_behind_the_final_one_adds_nothing(
    redis_server: RedisProcess,
):
    db = aioredis.from_url(redis_server.url)
    run_id = uuid.uuid4().hex
    key = f"omniflow:run:{run_id}"
    try:
        manager = RunManager(db, caller=None, owner_id="test", run_ttl_s=60)  # type: ignore[arg-type]
        live = LiveRun(cpb.Run(run_id=run_id, state=cpb.RUN_STATE_SUCCEEDED))
        live.emit(node_started=cpb.NodeStarted(node="n"))
        finished = live.event(run_finished=cpb.RunFinished(state=cpb.RUN_STATE_SUCCEEDED))
        final = asyncio.create_task(manager._flush(live, finished))
        periodic = asyncio.create_task(manager._flush(live))  # waits for the final one
        await asyncio.gather(final, periodic)
        live.publish(finished)
        await manager._flush(live)  # the flush loop's next turn, before the run is dropped
        assert await db.llen(f"{key}:events") == 2
        assert 0 < await db.ttl(key) <= 60  # the record keeps its expiry
    finally:
        await db.delete(key, f"{key}:events")
        await db.aclose()
