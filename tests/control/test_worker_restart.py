"""A run whose only worker of a role restarts waits for it, whatever the node's retry
policy: real router, coordinator and echo TEST worker processes on a private Redis; the
restart is what the supervisor does (SIGKILL, then the same command on the same port).

- killed mid-call (the call fails UNAVAILABLE before its first chunk) and back 1.5 s later;
- killed before the run is sent and back only after its registration expired (the router
  answers "no live worker of role 'llm'" meanwhile);
- the control: an UNAVAILABLE the operation raises itself, from a worker that is up, is the
  node's retry policy's to handle and still fails the run at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from conftest import ECHO

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.client import Client
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.testing.launch import ServiceProc

# The worker's registration outlives it by about a second (TTL) when it is SIGKILLed.
WORKER_ENV = {
    "OMNIFLOW_REGISTRATION_TTL_S": "1",
    "OMNIFLOW_ECHO_TOKEN_DELAY_MS": "300",
    "OMNIFLOW_WORKER_ENGINE": "echo",  # ECHO is the worker with the echo TEST engine
}


def _lone() -> Workflow:
    wf = Workflow("lone-worker")  # no retry policy: only the wait can save it
    wf.output("t", wf.call("say", "llm", "generate", prompt=wf.input("p", VType.TEXT))["text"])
    return wf


def _restart(launch: Callable[..., ServiceProc], dead: ServiceProc, name: str) -> ServiceProc:
    port = dead.address.rsplit(":", 1)[1]
    return launch(ECHO, name, OMNIFLOW_WORKER_ROLE="llm", OMNIFLOW_PORT=port, **WORKER_ENV)


async def test_a_run_waits_for_its_lone_worker_killed_mid_call(
    cluster: Callable[..., dict[str, ServiceProc]], launch: Callable[..., ServiceProc]
) -> None:
    procs = cluster({"llm": 1}, worker_env=WORKER_ENV)
    worker = procs["llm-0"]

    async def supervise() -> None:  # SIGKILL mid-call, the same command back 1.5 s later
        worker.kill()
        await asyncio.sleep(1.5)
        await asyncio.to_thread(_restart(launch, worker, "llm-0-again").wait_ready)

    async with Client(procs["coordinator"].address) as client:
        await client.register(_lone())
        assert (await client.run("lone-worker", {"p": "warm"})).outputs == {"t": "echo: warm"}
        restart = None
        async for ev in client.stream("lone-worker", {"p": "one two three four five six"}):
            if ev.HasField("node_started") and restart is None:
                restart = asyncio.create_task(supervise())
            last = ev
        assert restart is not None
        await restart
    fin = last.run_finished
    assert fin.state == cpb.RUN_STATE_SUCCEEDED, fin.error
    assert fin.outputs["t"].text == "echo: one two three four five six"


async def test_a_run_sent_while_its_worker_is_gone_waits_for_it(
    cluster: Callable[..., dict[str, ServiceProc]], launch: Callable[..., ServiceProc]
) -> None:
    procs = cluster({"llm": 1}, worker_env=WORKER_ENV)
    worker = procs["llm-0"]
    async with Client(procs["coordinator"].address) as client:
        await client.register(_lone())
        assert (await client.run("lone-worker", {"p": "warm"})).ok  # the role is known
        worker.kill()
        run = asyncio.create_task(client.run("lone-worker", {"p": "still here"}))
        await asyncio.sleep(4.0)  # its registration expired: the router has no llm worker
        _restart(launch, worker, "llm-0-again").wait_ready()
        result = await run
    assert result.ok, result.error
    assert result.outputs == {"t": "echo: still here"}


async def test_an_operations_own_unavailable_is_not_waited_for(
    cluster: Callable[..., dict[str, ServiceProc]],
) -> None:
    register_operation("echo", "fail", {"text": VType.TEXT}, {"text": VType.TEXT})
    procs = cluster({"echo": 1})
    wf = Workflow("own-failure")
    wf.output("t", wf.call("f", "echo", "fail", text=wf.input("t", VType.TEXT))["text"])
    async with Client(procs["coordinator"].address) as client:
        await client.register(wf)
        ended = await client.run("own-failure", {"t": "x"})
    assert not ended.ok
    assert "fails on purpose" in ended.error and "after 1 attempt" in ended.error, ended.error


def test_what_counts_as_a_restarting_worker() -> None:
    from omniflow.errors import NotFound, Unavailable
    from omniflow.rpc.interceptors import ServingGate
    from omniflow_services.coordinator.waiting import restarting

    assert restarting(ServingGate("worker").refusal("Generate"))  # loading its model
    assert restarting(Unavailable("failed to connect to all addresses; Connection refused"))
    assert restarting(Unavailable("Socket closed"))  # died mid-call
    assert not restarting(Unavailable("test worker llm-0 fails on purpose"))  # its own answer
    assert not restarting(NotFound("no live worker of role 'llm'"))  # the pick's, not a call's
