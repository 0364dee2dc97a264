"""Runs against real processes: router, coordinator and echo TEST workers on a private
Redis. The example workflows through the CLI; the reliability behaviours of the issue."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.client import Client
from omniflow.dsl import Retry, VType, Workflow, register_operation
from omniflow.errors import InvalidArgument, NotFound, ResourceExhausted
from omniflow.rpc.client import open_channel
from omniflow.values import to_python

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "workflows"

register_operation(
    "echo", "sleep", {"ms": VType.INT}, {"slept_ms": VType.FLOAT, "worker": VType.TEXT}
)


def cli(coordinator: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMNIFLOW_COORDINATOR_ADDR": coordinator}
    return subprocess.run(
        [sys.executable, "-m", "omniflow.cli.workflow", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def worker_stats(address: str) -> dict:
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        reply = await stub.Invoke(worker_pb2.InvokeRequest(operation="stats"))
    return {k: to_python(v) for k, v in reply.outputs.items()}


def sleeper(name: str, ms: int, retry: Retry | None = None, deadline_ms: int = 0) -> Workflow:
    wf = Workflow(name, deadline_ms=deadline_ms)
    n = wf.call("nap", "echo", "sleep", ms=ms, retry=retry)
    wf.output("worker", n["worker"])
    return wf


def test_examples_register_and_run_from_the_cli(cluster):
    procs = cluster({"llm": 2})
    addr = procs["coordinator"].address
    for example in ("chain", "switch", "loop", "fanout"):
        done = cli(addr, "workflow", "register", str(EXAMPLES / f"{example}.py"))
        assert done.returncode == 0, done.stderr
        assert "registered" in done.stdout and "v1" in done.stdout

    done = cli(addr, "run", "chain", "--input", "question=what is a page")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["draft"] == "echo: what is a page"
    # polish ran on the draft's chunks as they streamed, each call echoing its chunk
    assert out["answer"].startswith("echo: echo:") and out["answer"].endswith("page")
    assert "> draft on llm-" in done.stderr and "ok polish" in done.stderr

    done = cli(addr, "run", "route", "-i", "question=a b c d e f g h")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["answer"] == "echo: echo: a b c d e f"
    assert "? by_length -> long" in done.stderr and "? by_style -> default" in done.stderr
    done = cli(addr, "run", "route", "-i", "question=hi", "-i", "style=terse")
    assert json.loads(done.stdout)["answer"] == "echo: echo: hi"
    assert "? by_length -> default" in done.stderr and "? by_style -> styled" in done.stderr

    done = cli(addr, "run", "refine", "-i", "text=x")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"text": "echo: echo: echo: echo: x", "tokens": 5}
    assert "rounds[3]/rewrite" in done.stderr and "rounds[4]" not in done.stderr

    done = cli(addr, "run", "fanout", "-i", 'questions=["a", "b c", "d"]')
    assert json.loads(done.stdout)["answers"] == ["echo: a", "echo: b c", "echo: d"]

    shown = cli(addr, "workflow", "show", "refine", "--format", "dot")
    assert shown.returncode == 0 and 'digraph "refine"' in shown.stdout

    bad = cli(addr, "run", "chain", "-i", "nope=1")
    assert bad.returncode == 2 and "has no input 'nope'" in bad.stderr
    missing = cli(addr, "run", "nothing")
    assert missing.returncode == 2 and "unknown workflow 'nothing'" in missing.stderr


async def test_bad_input_is_rejected_with_names(cluster):
    procs = cluster({"llm": 1})
    async with Client(procs["coordinator"].address) as client:
        wf = Workflow("typed")
        n = wf.input("n", VType.INT)
        t = wf.input("t", VType.TEXT)
        wf.output("o", wf.call("g", "llm", "generate", prompt=t)["text"])
        wf.output("n", n)
        await client.register(wf)
        with pytest.raises(InvalidArgument, match="input 'n' must be int, got text"):
            await client.submit("typed", {"n": "three", "t": "x"})
        with pytest.raises(InvalidArgument, match="input 't' of 'typed' is required"):
            await client.submit("typed", {"n": 3})
        with pytest.raises(NotFound, match="unknown workflow 'ghost'"):
            await client.submit("ghost", {})
        with pytest.raises(NotFound, match="unknown run"):
            await client.get_run("0" * 32)
        # An invalid graph sent as a raw message: rejected at registration, naming the node.
        graph = wf.compile()
        graph.nodes[0].inputs["prompt"].graph_input = "missing"
        with pytest.raises(InvalidArgument, match=r"node 'g': reads input 'missing'"):
            await client.register(graph)
        assert await client.register(wf) == 2  # versions grow


async def test_concurrency_limit_deadline_and_cancel_reach_the_workers(cluster):
    procs = cluster({"echo": 1}, coordinator_env={"OMNIFLOW_COORDINATOR_MAX_RUNS": "2"})
    worker = procs["echo-0"].address
    async with Client(procs["coordinator"].address) as client:
        await client.register(sleeper("slow", 20_000))
        first = await client.submit("slow", {})
        second = await client.submit("slow", {})
        with pytest.raises(ResourceExhausted, match="2 runs in progress, the limit is 2"):
            await client.submit("slow", {})
        # Wait until both calls are running on the worker, then cancel one.
        for _ in range(200):
            if (await worker_stats(worker))["running"] == 2:
                break
            await asyncio.sleep(0.05)
        assert await client.cancel(first, "test") == "cancelled"
        run = await client.get_run(first)
        assert run.error == "cancelled: test"
        # A run past its deadline fails and its in-flight call is cancelled on the worker.
        result = await client.run("slow", {}, deadline_ms=300)
        assert result.state == "failed"
        assert "deadline of 300 ms exceeded; cancelled nodes: nap" in result.error
        await client.cancel(second)
        for _ in range(100):
            stats = await worker_stats(worker)
            if stats["cancelled"] >= 3 and stats["running"] == 0:
                break
            await asyncio.sleep(0.05)
        assert stats["cancelled"] == 3 and stats["running"] == 0


async def test_sigkill_a_worker_mid_run(cluster):
    # How long a call waits for a worker of its role to be back (nobody restarts them here).
    procs = cluster({"echo": 2}, coordinator_env={"OMNIFLOW_COORDINATOR_WORKER_WAIT_S": "2"})
    async with Client(procs["coordinator"].address) as client:
        await client.register(
            sleeper("retried", 1500, Retry(max_attempts=3, initial_backoff_ms=10))
        )
        await client.register(sleeper("fragile", 1500))
        # A worker that died under a call is waited out (services/coordinator/waiting.py),
        # with a retry policy or not, and that is not an attempt of the node's: the first
        # call is made again on the other worker; the second loses the last one, and fails
        # once the wait is over.
        for name, expect_ok in (("retried", True), ("fragile", False)):
            run_id = await client.submit(name, {})
            victim = ""
            async for ev in client.events(run_id):
                if ev.HasField("node_started") and not victim:
                    victim = ev.node_started.worker_id
                    procs[victim].kill()
                if ev.HasField("run_finished"):
                    finished = ev.run_finished
                    break
            run = await client.get_run(run_id)
            (nap,) = [n for n in run.nodes if n.node == "nap"]
            assert victim
            if expect_ok:
                assert finished.state == 3, finished.error  # SUCCEEDED
                assert to_python(finished.outputs["worker"]) != victim and nap.attempts == 1
            else:
                assert finished.state == 4  # FAILED, naming the node
                assert "node 'nap' failed: UNAVAILABLE" in finished.error, finished.error


async def test_restarted_coordinator_fails_interrupted_runs_and_keeps_finished_ones(
    cluster, launch
):
    procs = cluster({"echo": 1}, coordinator_env={"OMNIFLOW_REGISTRATION_TTL_S": "1"})
    async with Client(procs["coordinator"].address) as client:
        await client.register(sleeper("quick", 1))
        await client.register(sleeper("long", 30_000))
        done = await client.run("quick", {})
        assert done.ok
        interrupted = await client.submit("long", {})
        await asyncio.sleep(0.3)  # let the record reach Redis
    procs["coordinator"].kill()
    again = launch(
        "omniflow_services.coordinator",
        "coordinator-again",
        OMNIFLOW_INSTANCE_ID="coordinator",  # the same id: its own old runs are orphans
        OMNIFLOW_ROUTER_ADDR=procs["router"].address,
        OMNIFLOW_COORDINATOR_RESUME_ORPHANS="false",  # resuming: test_failover.py
    ).wait_ready()
    async with Client(again.address) as client:
        old = await client.get_run(done.run_id)
        assert old.state == 3 and to_python(old.outputs["worker"]) == "echo-0"
        run = await client.get_run(interrupted)
        assert run.state == 4 and "interrupted: coordinator coordinator restarted" in run.error
        events = [ev async for ev in client.events(interrupted)]
        assert events[-1].run_finished.state == 4
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        replay = [ev async for ev in client.events(done.run_id, from_seq=2)]
        assert replay[0].seq == 2 and replay[-1].HasField("run_finished")


def test_examples_on_real_llm_workers(cluster, launch, tmp_path):
    """The same examples on two real llm workers (the built-in engine, a tiny random
    qwen2 generated on first use): every run succeeds with text from the model."""
    env = {
        "OMNIFLOW_WORKER_ROLE": "llm",
        "OMNIFLOW_WORKER_MODEL": "tiny:qwen2",
        "OMNIFLOW_MODELS_DIR": str(tmp_path / "models"),
    }
    workers = [launch("omniflow_services.worker", f"real-llm-{i}", **env) for i in range(2)]
    for w in workers:
        w.wait_ready(timeout_s=180)
    procs = cluster({})
    addr = procs["coordinator"].address
    for example in ("chain", "switch", "loop"):
        done = cli(addr, "workflow", "register", str(EXAMPLES / f"{example}.py"))
        assert done.returncode == 0, done.stderr
    for name, inputs in (
        ("chain", ["question=what is a page"]),
        ("route", ["question=explain caches", "style=terse"]),
        ("refine", ["text=a haiku"]),
    ):
        done = cli(addr, "run", name, *[a for i in inputs for a in ("-i", i)])
        assert done.returncode == 0, done.stderr + "".join(w.tail() for w in workers)
        out = json.loads(done.stdout)
        assert all(isinstance(v, str | int) for v in out.values()) and out
        assert "real-llm-" in done.stderr and " on llm-" not in done.stderr
