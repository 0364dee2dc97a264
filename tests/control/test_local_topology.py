"""The example workflows registered and run from the CLI against the local topology
that `omniflow up` starts (kv-index, kv-agent, router, coordinator, two real llm
workers on a tiny qwen2); `omniflow down` leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "workflows"


def _run(cmd: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.usefixtures("redis_binary")
def test_examples_on_the_local_topology(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(tmp_path / "run"),
        "OMNIFLOW_MODELS_DIR": str(tmp_path / "models"),
        "OMNIFLOW_GATEWAY_PORT": "0",  # not the fixed default: tests may run side by side
    }
    env.pop("OMNIFLOW_REDIS_URL", None)
    env.pop("OMNIFLOW_COORDINATOR_ADDR", None)  # found through the run folder
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        'node: test-node\nworkers:\n  - {role: llm, count: 2, model: "tiny:qwen2"}\n'
    )
    # The workflow commands, as `omniflow workflow ...` runs them once main.py hooks them.
    wf = [sys.executable, "-m", "omniflow.cli.workflow"]
    try:
        up = _run([OMNIFLOW, "up", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        for example in ("chain", "switch", "loop"):
            done = _run([*wf, "workflow", "register", str(EXAMPLES / f"{example}.py")], env)
            assert done.returncode == 0, done.stderr
        listed = _run([*wf, "workflow", "list"], env)
        assert {"chain", "route", "refine"} <= {
            line.split("\t")[0] for line in listed.stdout.splitlines()
        }
        for name, inputs in (
            ("chain", ["question=what is a page"]),
            ("route", ["question=explain caches"]),
            ("refine", ["text=a haiku"]),
        ):
            done = _run([*wf, "run", name, *[a for i in inputs for a in ("-i", i)]], env)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)
            assert f"run {name} v1" in done.stderr and "succeeded: run" in done.stderr
            assert "> " in done.stderr and " on llm-" in done.stderr  # live node progress
    finally:
        down = _run([OMNIFLOW, "down"], env)
    assert down.returncode == 0, down.stdout + down.stderr
