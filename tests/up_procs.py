"""The supervised topology of ``omniflow up`` as its tests see it: the CLI, ``state.json``,
and the live processes started as one of its instances."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))


def omniflow_cli(
    args: list[str], env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess:
    """``omniflow ARGS`` with ``env`` (its run folder), its output captured."""
    return subprocess.run(
        [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def check_down(down: subprocess.CompletedProcess, pids: list[int]) -> None:
    """``omniflow down`` (its result ``down``) succeeded and none of ``pids`` is left."""
    assert down.returncode == 0, down.stdout + down.stderr
    left = [
        p for p in pids if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert not left, "processes left behind"


def up_state(run: Path) -> dict:
    return json.loads((run / "state.json").read_text())


def procs_by_name(run: Path) -> dict[str, dict]:
    """``state.json``'s processes by instance name."""
    return {p["name"]: p for p in up_state(run)["procs"]}


def instance_pids(run: Path, name: str = "") -> list[int]:
    """PIDs of live processes started as instance ``name`` (any, when empty) of the topology
    in ``run`` (their environment says so: other topologies on the machine have an
    ``llm-1`` too)."""
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


def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """Until ``cond()`` holds, checked every 0.1 s; fails naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")
