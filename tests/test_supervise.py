"""`omniflow up` supervises what it starts: a SIGKILLed service (Redis included) comes back
by itself on its old address, restarts show in `omniflow status`, a workflow registered
before Redis died is still there, and `down` (supervisor first) leaves no process behind.
Real processes with TEST echo workers (no model), a Redis that `up` starts itself."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omniflow.client import Client
from omniflow.dsl import VType, Workflow
from omniflow.security.local import local_client

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))


def _run(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _alive(pid: int) -> bool:
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def _wait_restarted(run_dir: Path, env: dict, names: set[str], timeout_s: float = 60) -> str:
    end = time.monotonic() + timeout_s
    out = ""
    while time.monotonic() < end:
        status = _run(["status"], env, timeout=30)
        out = status.stdout
        rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
        if status.returncode == 0 and all(n in rows and rows[n][-2] != "0" for n in names):
            return out
        time.sleep(0.5)
    raise AssertionError(f"not restarted and healthy within {timeout_s}s:\n{out}")


def _shout() -> Workflow:
    wf = Workflow("shout")
    reply = wf.call("say", "llm", "generate", prompt=wf.input("text", VType.TEXT))
    wf.output("text", reply["text"])
    return wf


@pytest.mark.integration
@pytest.mark.usefixtures("redis_binary")
def test_up_restarts_killed_services_and_down_ends_all(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(run_dir), "OMNIFLOW_GATEWAY_PORT": "0"}
    env.pop("OMNIFLOW_REDIS_URL", None)
    topology = tmp_path / "topology.yaml"
    topology.write_text("node: sup\nworkers:\n  - {role: llm, count: 1, program: echo}\n")
    pids: set[int] = set()
    try:
        up = _run(["up", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "RESTARTS" in up.stdout
        state = _state(run_dir)
        assert stat.S_IMODE((run_dir / "state.json").stat().st_mode) == 0o600
        password = state["env"]["OMNIFLOW_REDIS_URL"].split("@")[0].rsplit(":", 1)[-1]
        assert password and password not in up.stdout + up.stderr
        pids = {p["pid"] for p in state["procs"]} | {state["supervisor"]}
        by_name = {p["name"]: p for p in state["procs"]}
        coordinator = by_name["coordinator"]["address"]

        async def register_and_run() -> str:
            async with Client(coordinator) as client:
                await client.register(_shout())
                return (await client.run("shout", {"text": "a"})).outputs["text"]

        with local_client(run_dir):  # up runs mutual TLS + auth: the run folder's client cert
            assert asyncio.run(register_and_run()) == "echo: a"

        for name in ("redis", "router", "llm-1"):
            os.kill(by_name[name]["pid"], signal.SIGKILL)
        status = _wait_restarted(run_dir, env, {"redis", "router", "llm-1"})
        after = {p["name"]: p for p in _state(run_dir)["procs"]}
        pids |= {p["pid"] for p in after.values()}
        assert after["router"]["address"] == by_name["router"]["address"], status
        assert after["router"]["pid"] != by_name["router"]["pid"]

        async def still_there() -> tuple[list[str], str]:
            async with Client(coordinator) as client:
                end = time.monotonic() + 30
                while True:  # the coordinator finds the restarted router through discovery
                    result = await client.run("shout", {"text": "b"})
                    if result.ok or time.monotonic() > end:
                        break
                    await asyncio.sleep(0.5)
                names = [w.name for w in await client.list_workflows()]
                return names, result.outputs.get("text", result.error)

        with local_client(run_dir):
            assert asyncio.run(still_there()) == (["shout"], "echo: b")
        for log in (run_dir / "logs").glob("*.log"):
            assert password not in log.read_text(errors="replace"), log.name
    finally:
        down = _run(["down"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped the supervisor" in down.stdout
    time.sleep(0.5)
    assert pids and not [p for p in pids if _alive(p)], "processes left behind"
