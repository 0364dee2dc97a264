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
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))
TOPOLOGY = "node: disk\nworkers:\n  - {role: llm, count: 1, program: echo}\n"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=240, check=False
    )


def _by_name(run: Path) -> dict[str, dict]:
    return {p["name"]: p for p in json.loads((run / "state.json").read_text())["procs"]}


def _instances(run: Path, name: str) -> list[int]:
    """PIDs of live processes of instance ``name`` of the topology in ``run``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
            continue
        if f"OMNIFLOW_RUN_DIR={run}".encode() in env and (
            not name or f"OMNIFLOW_INSTANCE_ID={name}".encode() in env
        ):
            found.append(int(entry.name))
    return found


def _wait(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


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
        up = _run(["up", "--topology", str(spec)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            yield run, env
        finally:
            (run / "filler").unlink(missing_ok=True)
            down = _run(["down"], env)
            assert down.returncode == 0, down.stdout + down.stderr
            left = _instances(run, "")
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            assert not left, f"processes left behind by omniflow down: {left}"
    finally:
        subprocess.run(["umount", "-l", str(run)], check=False)


def test_a_full_disk_waits_for_space_and_is_reported(topology) -> None:
    run, env = topology
    supervisor = json.loads((run / "state.json").read_text())["supervisor"]
    worker = _by_name(run)["llm-1"]
    _fill(run / "filler")
    os.kill(worker["pid"], signal.SIGKILL)
    time.sleep(5)  # twenty supervision passes
    assert _instances(run, "llm-1") == []  # no restart that could not write its files
    os.kill(supervisor, 0)  # still running
    status = _run(["status"], env)
    assert "disk full" in status.stdout and "RUNNING" in status.stdout, status.stdout
    assert status.returncode != 0

    (run / "filler").unlink()
    _wait(lambda: len(_instances(run, "llm-1")) == 1, 15, "llm-1 restarted with space again")
    live = _instances(run, "llm-1")
    _wait(lambda: _by_name(run)["llm-1"]["pid"] == live[0], 10, "state.json written")
    assert _by_name(run)["llm-1"]["restarts"] == worker["restarts"] + 1
    ready = run / "ready" / "llm-1.json"
    _wait(lambda: ready.exists() and json.loads(ready.read_text())["pid"] == live[0], 60,
          "llm-1 SERVING again")  # fmt: skip
    time.sleep(1)
    assert _instances(run, "llm-1") == live  # restarted once
    status = _run(["status"], env)
    assert status.returncode == 0 and "disk full" not in status.stdout, status.stdout


def test_down_stops_a_restart_that_state_json_does_not_name(topology) -> None:
    run, env = topology
    supervisor = json.loads((run / "state.json").read_text())["supervisor"]
    (run / f"state.json.{supervisor}.tmp").mkdir()  # the file cannot be written any more
    worker = _by_name(run)["llm-1"]
    os.kill(worker["pid"], signal.SIGKILL)
    _wait(lambda: _instances(run, "llm-1") not in ([], [worker["pid"]]), 15, "llm-1 restarted")
    assert _by_name(run)["llm-1"]["pid"] == worker["pid"]  # the file does not name it
    restarted = _instances(run, "llm-1")
    down = _run(["down"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    _wait(lambda: not _instances(run, ""), 10, "every process of the topology gone")
    assert restarted and not any(Path(f"/proc/{pid}").exists() for pid in restarted)
