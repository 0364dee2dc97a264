"""The supervisor on a real full disk, and ``omniflow down`` after restarts it could not
record. ``omniflow up`` of echo TEST workers with its run folder (logs, state.json, ready
files, Redis's AOF) on a tmpfs the test mounts (unmounted after; skips, saying why, when
mounting is not allowed) and fills:

- a worker killed while the disk is full is not restarted (nor respawned on every pass):
  the supervisor keeps running and ``omniflow status`` says the disk is full; once space
  returns the worker is restarted once, SERVING, and counted once;
- a worker restarted while ``state.json`` cannot be written (its temporary file's name
  taken) is still stopped by ``omniflow down``: no process of the topology is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from up_procs import instance_pids, omniflow_cli, procs_by_name, wait_for

pytestmark = pytest.mark.integration

TOPOLOGY = "node: disk\nworkers:\n  - {role: llm, count: 1, program: echo}\n"


def _fill(path: Path) -> None:
    with open(path, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass


@pytest.fixture
def topology(tmp_path: Path, redis_binary: Path):
    run = tmp_path / "run"
    run.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(run)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"needs to mount a tmpfs (root): {mounted.stderr.strip()}")
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(run), "OMNIFLOW_GATEWAY_PORT": "0"}
    env.pop("OMNIFLOW_REDIS_URL", None)
    spec = tmp_path / "topology.yaml"
    spec.write_text(TOPOLOGY)
    try:
        up = omniflow_cli(["up", "--topology", str(spec)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            yield run, env
        finally:
            (run / "filler").unlink(missing_ok=True)
            down = omniflow_cli(["down"], env)
            assert down.returncode == 0, down.stdout + down.stderr
            left = instance_pids(run, "")
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            assert not left, f"processes left behind by omniflow down: {left}"
    finally:
        subprocess.run(["umount", "-l", str(run)], check=False)


def test_a_full_disk_waits_for_space_and_is_reported(topology) -> None:
    run, env = topology
    supervisor = json.loads((run / "state.json").read_text())["supervisor"]
    worker = procs_by_name(run)["llm-1"]
    _fill(run / "filler")
    os.kill(worker["pid"], signal.SIGKILL)
    time.sleep(5)  # twenty supervision passes
    assert instance_pids(run, "llm-1") == []  # no restart that could not write its files
    os.kill(supervisor, 0)  # still running
    status = omniflow_cli(["status"], env)
    assert "disk full" in status.stdout and "RUNNING" in status.stdout, status.stdout
    assert status.returncode != 0

    (run / "filler").unlink()
    wait_for(lambda: len(instance_pids(run, "llm-1")) == 1, 15, "llm-1 restarted with space again")
    live = instance_pids(run, "llm-1")
    wait_for(lambda: procs_by_name(run)["llm-1"]["pid"] == live[0], 10, "state.json written")
    assert procs_by_name(run)["llm-1"]["restarts"] == worker["restarts"] + 1
    ready = run / "ready" / "llm-1.json"
    wait_for(lambda: ready.exists() and json.loads(ready.read_text())["pid"] == live[0], 60,
             "llm-1 SERVING again")  # fmt: skip
    time.sleep(1)
    assert instance_pids(run, "llm-1") == live  # restarted once
    status = omniflow_cli(["status"], env)
    assert status.returncode == 0 and "disk full" not in status.stdout, status.stdout


def test_down_stops_a_restart_that_state_json_does_not_name(topology) -> None:
    run, env = topology
    supervisor = json.loads((run / "state.json").read_text())["supervisor"]
    (run / f"state.json.{supervisor}.tmp").mkdir()  # the file cannot be written any more
    worker = procs_by_name(run)["llm-1"]
    os.kill(worker["pid"], signal.SIGKILL)
    wait_for(
        lambda: instance_pids(run, "llm-1") not in ([], [worker["pid"]]), 15, "llm-1 restarted"
    )
    assert procs_by_name(run)["llm-1"]["pid"] == worker["pid"]  # the file does not name it
    restarted = instance_pids(run, "llm-1")
    down = omniflow_cli(["down"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    wait_for(lambda: not instance_pids(run, ""), 10, "every process of the topology gone")
    assert restarted and not any(Path(f"/proc/{pid}").exists() for pid in restarted)
