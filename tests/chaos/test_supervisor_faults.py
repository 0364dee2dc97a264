"""The supervisor and `omniflow up` under faults, with real processes (``omniflow up`` in a
run folder of the test's own, echo TEST workers, a Redis `up` starts itself):

- a router killed again and again right after each restart keeps its port (it is free);
- with ``state.json`` unwritable (as on a full disk) a killed worker is restarted once,
  not on every pass, the failure is in the supervisor's log, and the file is written, with
  the restart counted once, when it can be again;
- `omniflow up` on a run folder whose processes all died resumes the run that was in
  flight once the roles it calls are served (the coordinator starts before the workers).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from up_procs import instance_pids, omniflow_cli, procs_by_name, up_state, wait_for

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.client import Client
from omniflow.dsl import VType, Workflow
from omniflow.security.local import local_client

pytestmark = pytest.mark.integration

# Half a second per generated word: a generation of a few words is a run still in flight.
TOPOLOGY = (
    "node: sup\nworkers:\n  - {role: llm, count: 1, program: echo, "
    "env: {OMNIFLOW_ECHO_TOKEN_DELAY_MS: '500'}}\n"
)
PROMPT = "one two three four five six seven eight"


@pytest.fixture
def topology(tmp_path: Path, redis_binary: Path):
    run = tmp_path / "run"
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(run), "OMNIFLOW_GATEWAY_PORT": "0"}
    env.pop("OMNIFLOW_REDIS_URL", None)
    spec = tmp_path / "topology.yaml"
    spec.write_text(TOPOLOGY)
    up = omniflow_cli(["up", "--topology", str(spec)], env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield run, env, spec
    finally:
        down = omniflow_cli(["down"], env)
        assert down.returncode == 0, down.stdout + down.stderr


def test_the_supervisor_keeps_ports_and_survives_an_unwritable_state(topology) -> None:
    run, _, _ = topology
    before = procs_by_name(run)
    address = before["router"]["address"]
    for n in (1, 2, 3):  # killed again as soon as it is back: "died twice within 5 s"
        old = procs_by_name(run)["router"]["pid"]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda old=old: procs_by_name(run)["router"]["pid"] != old, 30, f"restart {n}")
    ready = run / "ready" / "router.json"
    wait_for(lambda: ready.exists() and json.loads(ready.read_text())["pid"] ==
             procs_by_name(run)["router"]["pid"], 60, "the router SERVING again")  # fmt: skip
    after = procs_by_name(run)["router"]
    assert after["address"] == address and json.loads(ready.read_text())["address"] == address
    assert after["restarts"] == 3

    # state.json cannot be written any more (its temporary file's name is taken).
    supervisor = up_state(run)["supervisor"]
    blocker = run / f"state.json.{supervisor}.tmp"
    blocker.mkdir()
    worker = procs_by_name(run)["llm-1"]
    os.kill(worker["pid"], signal.SIGKILL)
    time.sleep(6)  # many supervision passes
    live = instance_pids(run, "llm-1")
    assert len(live) == 1 and live[0] != worker["pid"], live  # restarted once, not per pass
    log = (run / "logs" / "supervisor.log").read_text()
    assert "cannot write" in log
    assert procs_by_name(run)["llm-1"]["pid"] == worker["pid"]  # the file is stale meanwhile
    blocker.rmdir()
    wait_for(lambda: procs_by_name(run)["llm-1"]["pid"] == live[0], 10, "state.json written again")
    assert procs_by_name(run)["llm-1"]["restarts"] == worker["restarts"] + 1


def _slow() -> Workflow:
    wf = Workflow("slow")
    wf.output("text", wf.call("say", "llm", "generate", prompt=wf.input("p", VType.TEXT))["text"])
    return wf


def test_up_on_a_dead_run_folder_resumes_the_run_in_flight(topology) -> None:
    run, env, spec = topology
    coordinator = procs_by_name(run)["coordinator"]["address"]
    run_id = uuid.uuid4().hex

    async def submit() -> None:
        async with Client(coordinator) as client:
            await client.register(_slow())
            await client.submit("slow", {"p": PROMPT}, run_id=run_id)
            await asyncio.sleep(1.0)  # running, recorded (flushed) in Redis's AOF
            assert (await client.get_run(run_id)).state == cpb.RUN_STATE_RUNNING

    with local_client(run):
        asyncio.run(submit())
    time.sleep(1.2)  # Redis's AOF is fsynced every second
    # Every process dies at once: the supervisor first (nothing restarts them).
    state = up_state(run)
    os.kill(state["supervisor"], signal.SIGKILL)
    for p in state["procs"]:
        os.kill(p["pid"], signal.SIGKILL)
    names = [p["name"] for p in state["procs"] if p["name"] != "redis"]
    wait_for(lambda: not any(instance_pids(run, n) for n in names), 15, "every process gone")
    again = omniflow_cli(["up", "--topology", str(spec)], env)
    assert again.returncode == 0, again.stdout + again.stderr
    coordinator = procs_by_name(run)["coordinator"]["address"]

    async def outcome() -> cpb.Run:
        async with Client(coordinator) as client:
            end = time.monotonic() + 60
            while True:
                got = await client.get_run(run_id)
                if got.state != cpb.RUN_STATE_RUNNING or time.monotonic() > end:
                    return got
                await asyncio.sleep(0.5)

    with local_client(run):
        result = asyncio.run(outcome())
    assert result.state == cpb.RUN_STATE_SUCCEEDED, result.error
    assert result.outputs["text"].text == "echo: " + PROMPT
