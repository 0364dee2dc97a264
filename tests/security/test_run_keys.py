"""Run keys carry their tenant: real processes (Redis with a password, an echo worker, a
router, a coordinator, all on mutual TLS with tokens of two tenants and an admin).

- tenant A's run ``X`` lives under A's own keys; keys planted under the old plain layout
  (``omniflow:run:X``, ``omniflow:run:X:events``) neither break nor feed A's run ``X``;
- tenant B's GetRun, StreamRunEvents and CancelRun of A's run are NOT_FOUND; an admin
  reads it;
- runs written by the previous layout (plain id, owner record) are still read, and one
  that was in flight when its coordinator died is adopted and resumed; so is one of the
  tenant's own layout.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis.asyncio as aioredis
from pki_procs import PkiProcs, client_security, code_of, pki_procs

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.coordinator.v1 import coordinator_pb2_grpc
from omniflow.dsl import Workflow, register_operation
from omniflow.rpc.client import open_channel
from omniflow.security.identity import Identity
from omniflow.testing.launch import ServiceProc
from omniflow.values import VType

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})

NODE = "node-1"
SERVICES = {
    "echo-1": Identity("worker", NODE, "echo-1"),
    "router": Identity("router", NODE, "router"),
    "coordinator": Identity("coordinator", NODE, "coordinator"),
}
CLIENT = Identity("client", "laptop", "cli")
GRANTS = {"a": "tenant-a:user", "b": "tenant-b:user", "admin": ":admin"}


@dataclass
class Topo:
    pki: PkiProcs
    procs: dict[str, ServiceProc]

    def stub(
        self, token: str
    ) -> tuple[grpc.aio.Channel, coordinator_pb2_grpc.CoordinatorServiceStub]:
        sec = client_security(self.pki.bundle, CLIENT, self.pki.bundle.tokens[GRANTS[token]])
        channel = open_channel(self.procs["coordinator"].address, security=sec)
        return channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel)

    def db(self) -> aioredis.Redis:
        return aioredis.from_url(self.pki.redis.url, socket_timeout=5)


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topo]:
    folder = tmp_path_factory.mktemp("runkeys")
    with pki_procs(folder, SERVICES, [CLIENT], list(GRANTS.values())) as pki:
        # Adoption sweeps every 0.5 s.
        yield Topo(pki, pki.echo_control_plane(OMNIFLOW_REGISTRATION_TTL_S="1.5"))


def upper(name: str) -> cpb.RegisterWorkflowRequest:
    wf = Workflow(name)
    wf.output("text", wf.call("u", "echo", "upper", text=wf.input("text", VType.TEXT))["text"])
    return cpb.RegisterWorkflowRequest(graph=wf.compile())


def _name(tenant: str, run_id: str) -> str:
    return f"omniflow:run:{len(tenant)}:{tenant}/{run_id}"


def test_run_keys_carry_the_tenant(topo: Topo) -> None:
    asyncio.run(_keys_carry_the_tenant(topo))


async def _keys_carry_the_tenant(topo: Topo) -> None:
    suffix = os.urandom(4).hex()
    run_id = f"x-{suffix}"
    db = topo.db()
    a_ch, a = topo.stub("a")
    b_ch, b = topo.stub("b")
    admin_ch, admin = topo.stub("admin")
    try:
        await a.RegisterWorkflow(upper(f"keys-a-{suffix}"))
        await b.RegisterWorkflow(upper(f"keys-b-{suffix}"))
        # Keys planted under the plain layout before A's run exists (what a run id "X:events"
        # of another tenant used to write): junk events and a junk record.
        planted = f"omniflow:run:{run_id}"
        await db.rpush(f"{planted}:events", b"\xff not an event", b"junk")
        await db.set(planted, b"\xff not a run")
        inputs = {"text": common_pb2.Value(text="hello")}
        submit = cpb.SubmitRunRequest(workflow=f"keys-a-{suffix}", inputs=inputs, run_id=run_id)
        events = [e async for e in a.RunWorkflow(submit, timeout=60)]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].run_finished.state == cpb.RUN_STATE_SUCCEEDED
        assert events[-1].run_finished.outputs["text"].text == "HELLO"
        # Its record and events are under A's own keys; the planted keys are untouched.
        mine = _name("tenant-a", run_id)
        stored = cpb.Run()
        stored.ParseFromString(await db.get(mine))
        assert stored.run_id == run_id and stored.outputs["text"].text == "HELLO"
        assert await db.llen(f"{mine}:events") == len(events)
        assert await db.lrange(f"{planted}:events", 0, -1) == [b"\xff not an event", b"junk"]
        followed = [e async for e in a.StreamRunEvents(cpb.StreamRunEventsRequest(run_id=run_id))]
        assert followed == events
        # B: as if it did not exist; a run id naming another run's keys is refused.
        for call in (
            b.GetRun(cpb.GetRunRequest(run_id=run_id)),
            b.CancelRun(cpb.CancelRunRequest(run_id=run_id)),
            b.StreamRunEvents(cpb.StreamRunEventsRequest(run_id=run_id)),
        ):
            assert await code_of(call) == grpc.StatusCode.NOT_FOUND
        bad = cpb.SubmitRunRequest(
            workflow=f"keys-b-{suffix}", inputs=inputs, run_id=f"{run_id}:events"
        )
        assert await code_of(b.SubmitRun(bad)) == grpc.StatusCode.INVALID_ARGUMENT
        # B's own run is under B's keys, and A cannot see it.
        b_id = (
            await b.SubmitRun(cpb.SubmitRunRequest(workflow=f"keys-b-{suffix}", inputs=inputs))
        ).run_id
        b_events = [e async for e in b.StreamRunEvents(cpb.StreamRunEventsRequest(run_id=b_id))]
        assert b_events[-1].run_finished.state == cpb.RUN_STATE_SUCCEEDED
        assert await db.exists(_name("tenant-b", b_id)) and not await db.exists(
            f"omniflow:run:{b_id}"
        )
        assert await code_of(a.GetRun(cpb.GetRunRequest(run_id=b_id))) == grpc.StatusCode.NOT_FOUND
        # An admin reaches any tenant's run.
        seen = (await admin.GetRun(cpb.GetRunRequest(run_id=run_id))).run
        assert seen.outputs["text"].text == "HELLO"
        assert (await a.GetRun(cpb.GetRunRequest(run_id=run_id))).run == seen
    finally:
        for ch in (a_ch, b_ch, admin_ch):
            await ch.close()
        await db.aclose()


def test_runs_of_the_previous_layout_are_read_and_resumed(topo: Topo) -> None:
    asyncio.run(_previous_layout(topo))


async def _previous_layout(topo: Topo) -> None:
    suffix = os.urandom(4).hex()
    workflow = f"legacy-{suffix}"
    db = topo.db()
    a_ch, a = topo.stub("a")
    b_ch, b = topo.stub("b")
    try:
        await a.RegisterWorkflow(upper(workflow))
        version = (await a.GetWorkflow(cpb.GetWorkflowRequest(name=workflow))).graph.version
        # What the previous version wrote: a finished run under its plain id...
        done_id, flight_id = f"old-{suffix}", f"flight-{suffix}"
        done = cpb.Run(
            run_id=done_id, workflow=workflow, version=version, state=cpb.RUN_STATE_SUCCEEDED
        )
        done.outputs["text"].CopyFrom(common_pb2.Value(text="OLD"))
        finished = cpb.RunEvent(run_id=done_id, seq=1)
        finished.run_finished.state = cpb.RUN_STATE_SUCCEEDED
        await db.set(f"omniflow:run:{done_id}", done.SerializeToString())
        await db.rpush(f"omniflow:run:{done_id}:events", finished.SerializeToString())
        await db.set(f"omniflow:tenant:run:{done_id}", "tenant-a")
        got = (await a.GetRun(cpb.GetRunRequest(run_id=done_id))).run
        assert got.state == cpb.RUN_STATE_SUCCEEDED and got.outputs["text"].text == "OLD"
        old = [e async for e in a.StreamRunEvents(cpb.StreamRunEventsRequest(run_id=done_id))]
        assert old == [finished]
        assert (
            await code_of(b.GetRun(cpb.GetRunRequest(run_id=done_id))) == grpc.StatusCode.NOT_FOUND
        )
        # ...and a run in flight on a coordinator that died during the upgrade: adopted by
        # the running coordinator's sweep and resumed from its recorded inputs.
        flight = cpb.Run(
            run_id=flight_id, workflow=workflow, version=version, state=cpb.RUN_STATE_RUNNING
        )
        flight.inputs["text"].CopyFrom(common_pb2.Value(text="resume me"))
        await db.set(f"omniflow:run:{flight_id}", flight.SerializeToString())
        await db.set(f"omniflow:tenant:run:{flight_id}", "tenant-a")
        await db.hset("omniflow:runs:active", flight_id, "coordinator-gone")
        end = time.monotonic() + 60
        while True:
            run = (await a.GetRun(cpb.GetRunRequest(run_id=flight_id))).run
            if run.state != cpb.RUN_STATE_RUNNING or time.monotonic() > end:
                break
            await asyncio.sleep(0.25)
        assert run.state == cpb.RUN_STATE_SUCCEEDED, run
        assert run.outputs["text"].text == "RESUME ME"
        assert not await db.hexists("omniflow:runs:active", flight_id)
        code = await code_of(b.StreamRunEvents(cpb.StreamRunEventsRequest(run_id=flight_id)))
        assert code == grpc.StatusCode.NOT_FOUND
        # A run of this layout in flight on a coordinator that died: adopted under its
        # tenant's name, resumed (acting for its tenant again), and still A's alone.
        mine_id = f"mine-{suffix}"
        mine = cpb.Run(
            run_id=mine_id, workflow=workflow, version=version, state=cpb.RUN_STATE_RUNNING
        )
        mine.inputs["text"].CopyFrom(common_pb2.Value(text="mine"))
        await db.set(_name("tenant-a", mine_id), mine.SerializeToString())
        await db.set(f"omniflow:tenant:run:{mine_id}", "tenant-a")
        await db.hset("omniflow:runs:active", f"8:tenant-a/{mine_id}", "coordinator-gone")
        end = time.monotonic() + 60
        while True:
            run = (await a.GetRun(cpb.GetRunRequest(run_id=mine_id))).run
            if run.state != cpb.RUN_STATE_RUNNING or time.monotonic() > end:
                break
            await asyncio.sleep(0.25)
        assert run.state == cpb.RUN_STATE_SUCCEEDED and run.outputs["text"].text == "MINE", run
        assert not await db.exists(f"omniflow:run:{mine_id}")
        code = await code_of(b.GetRun(cpb.GetRunRequest(run_id=mine_id)))
        assert code == grpc.StatusCode.NOT_FOUND
    finally:
        for ch in (a_ch, b_ch):
            await ch.close()
        await db.aclose()
