"""No single point of failure in the control plane: a coordinator that dies has its
in-flight runs adopted and failed (with a reason) by another within the lease TTL, never
left RUNNING; the client fails over to the other coordinator and follows the run there;
a coordinator fails over between routers. Real processes (echo TEST workers) on a
private Redis."""

from __future__ import annotations

import pytest

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.client import Client
from omniflow.dsl import VType, Workflow, register_operation

pytestmark = pytest.mark.integration

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})
register_operation(
    "echo", "sleep", {"ms": VType.INT}, {"slept_ms": VType.FLOAT, "worker": VType.TEXT}
)
FAST_LEASE = {"OMNIFLOW_REGISTRATION_TTL_S": "1"}  # the coordinator's lease TTL follows it


def _slow() -> Workflow:
    wf = Workflow("slow")
    wf.output("slept_ms", wf.call("nap", "echo", "sleep", ms=wf.input("ms", VType.INT))["slept_ms"])
    return wf


def _shout() -> Workflow:
    wf = Workflow("shout")
    wf.output("text", wf.call("up", "echo", "upper", text=wf.input("text", VType.TEXT))["text"])
    return wf


def _echo_worker(launch) -> None:
    launch(
        "omniflow_services.worker",
        "echo-0",
        OMNIFLOW_WORKER_ENGINE="echo",
        OMNIFLOW_WORKER_ROLE="echo",
    ).wait_ready()


def _two_coordinators(launch, resume: bool) -> list:
    _echo_worker(launch)
    router = launch("omniflow_services.router", "router").wait_ready()
    return [
        launch(
            "omniflow_services.coordinator",
            f"coord-{x}",
            OMNIFLOW_ROUTER_ADDR=router.address,
            OMNIFLOW_COORDINATOR_RESUME_ORPHANS=str(resume).lower(),
            **FAST_LEASE,
        ).wait_ready()
        for x in "ab"
    ]


async def test_dead_coordinators_runs_are_resumed_by_another(launch) -> None:
    a, b = _two_coordinators(launch, resume=True)
    async with Client(f"{a.address},{b.address}", resume_s=30) as client:
        await client.register(_slow())
        events = []
        async for ev in client.stream("slow", {"ms": 1500}):
            events.append(ev)
            if ev.HasField("node_started") and len(events) == 1:
                a.kill()  # mid-run
        fin = events[-1].run_finished
        assert fin.state == cpb.RUN_STATE_SUCCEEDED, fin.error
        assert fin.outputs["slept_ms"].float_value >= 1500
        assert client.address == b.address
        run = await client.get_run(events[-1].run_id)
        assert run.state == cpb.RUN_STATE_SUCCEEDED  # recorded by b, same run id
    assert "resumed from its inputs" in b.tail()


async def test_dead_coordinators_runs_are_adopted_and_the_client_fails_over(launch) -> None:
    coords = _two_coordinators(launch, resume=False)
    a, b = coords
    async with Client(f"{a.address},{b.address}", resume_s=30) as client:
        assert client.address == a.address
        await client.register(_slow())
        await client.register(_shout())
        events = []
        async for ev in client.stream("slow", {"ms": 4000}):
            events.append(ev)
            if ev.HasField("node_started"):
                a.kill()  # mid-run: coordinator a's run is orphaned
        fin = events[-1].run_finished
        assert events[-1].HasField("run_finished")
        assert fin.state == cpb.RUN_STATE_FAILED
        assert "interrupted" in fin.error and "coord-a" in fin.error, fin.error
        assert client.address == b.address and client.failovers >= 1
        run = await client.get_run(events[-1].run_id)
        assert run.state == cpb.RUN_STATE_FAILED  # recorded, not RUNNING
        again = await client.run("shout", {"text": "after"})
        assert again.ok and again.outputs == {"text": "AFTER"}


async def test_coordinator_fails_over_between_routers(launch) -> None:
    _echo_worker(launch)
    routers = [launch("omniflow_services.router", f"router-{i}").wait_ready() for i in range(2)]
    coord = launch("omniflow_services.coordinator", "coordinator").wait_ready()
    async with Client(coord.address) as client:
        await client.register(_shout())
        assert (await client.run("shout", {"text": "one"})).outputs == {"text": "ONE"}
        first = min(routers, key=lambda r: r.address)  # the coordinator uses this one first
        first.kill()
        for word in ("two", "three", "four"):
            result = await client.run("shout", {"text": word})
            assert result.ok, result.error
            assert result.outputs == {"text": word.upper()}
