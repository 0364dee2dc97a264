"""``omniflow up`` starts a worker with the interpreter its env names (OMNIFLOW_WORKER_PYTHON):
how a vLLM worker runs from vLLM's own virtualenv next to the rest of the topology."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from vllm_cluster import VLLM_PYTHON, vllm_ready

from omniflow.cli import local


def test_a_worker_runs_with_the_python_its_env_names(tmp_path: Path, private_redis) -> None:
    why = vllm_ready()
    if why:
        pytest.skip(why)
    (tmp_path / "logs").mkdir()
    (tmp_path / "ready").mkdir()
    env = {
        "OMNIFLOW_WORKER_PYTHON": str(VLLM_PYTHON),
        "OMNIFLOW_REDIS_URL": private_redis.url,
        "OMNIFLOW_DISCOVERY": "redis",
        "OMNIFLOW_PORT": "0",
        "OMNIFLOW_METRICS_PORT": "-1",
        "OMNIFLOW_WORKER_MODEL": "",  # serves with no model: starts in seconds
    }
    proc = local._spawn(tmp_path, "llm-1", "worker", env)
    try:
        # Read once the child has exec'd: right after the fork its cmdline is empty (or the
        # parent's), so wait a little for the interpreter it names.
        argv0, end = "", time.monotonic() + 10
        while argv0 != str(VLLM_PYTHON) and time.monotonic() < end:
            argv0 = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            time.sleep(0.01)
        assert argv0 == str(VLLM_PYTHON)
        ready = tmp_path / "ready" / "llm-1.json"
        end = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < end, Path(proc.log).read_text(errors="replace")[-2000:]
            time.sleep(0.1)
        assert json.loads(ready.read_text())["address"]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        os.waitpid(proc.pid, 0)
