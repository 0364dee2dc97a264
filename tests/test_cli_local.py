"""`omniflow up` / `status` / `down` from a shell, as a user runs them; nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))


def _run(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _pid_alive(pid: int) -> bool:
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.usefixtures("redis_binary")
def test_up_status_down_leaves_no_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(run_dir),
        "OMNIFLOW_MODELS_DIR": str(tmp_path / "models"),
        "OMNIFLOW_GATEWAY_PORT": "0",  # not the fixed default: tests may run side by side
    }
    env.pop("OMNIFLOW_REDIS_URL", None)  # up must start its own Redis
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        'node: test-node\nworkers:\n  - {role: llm, count: 2, model: "tiny:qwen2"}\n'
    )
    pids: list[int] = []
    try:
        up = _run(["up", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((run_dir / "state.json").read_text())
        pids = [p["pid"] for p in state["procs"]]
        names = [p["name"] for p in state["procs"]]
        assert names == [
            "redis", "kv-index", "kv-agent", "router", "coordinator", "llm-1", "llm-2", "gateway"
        ]  # fmt: skip
        for name in names[1:]:
            line = next(x for x in up.stdout.splitlines() if x.startswith(name + " "))
            assert line.rstrip().endswith("SERVING"), up.stdout
        assert (run_dir / "logs" / "llm-2.log").exists()
        # Both workers loaded the one tiny model generated on first start.
        assert (tmp_path / "models" / "tiny-qwen2" / "model.safetensors").exists()

        status = _run(["status"], env)
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("SERVING") == 7

        again = _run(["up", "--topology", str(topology)], env)
        assert again.returncode == 1
        assert "already running" in again.stderr
    finally:
        down = _run(["down"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert pids and not [p for p in pids if _pid_alive(p)], "processes left behind"
    assert _run(["status"], env).returncode == 1


def test_bad_topology_is_rejected_with_the_entry_named(tmp_path: Path) -> None:
    topology = tmp_path / "bad.yaml"
    topology.write_text("workers:\n  - {role: llm}\n  - {role: painter}\n")
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(tmp_path / "run")}
    result = _run(["up", "--topology", str(topology)], env, timeout=60)
    assert result.returncode == 2
    assert "workers[1]: role 'painter' is not one of llm, encoder" in result.stderr
    assert not (tmp_path / "run" / "state.json").exists()
