"""A CLI given a coordinator address never takes another topology's credentials: a run
folder left by a secured `omniflow up` (its processes killed, `state.json` and
`pki/client.json` still there) does not turn the CLI's channel to a plaintext topology into
a TLS one. Real processes: router, coordinator and echo workers on a private Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniflow.security import local as local_security

pytestmark = pytest.mark.integration


def _stale_secured_run_folder(folder: Path) -> None:
    """What a secured `omniflow up` whose processes all died leaves behind."""
    folder.mkdir(parents=True)
    local_security.prepare(folder, "gone-node", [("coordinator", "coordinator")])
    dead = {"name": "coordinator", "service": "coordinator", "pid": 2**22 + 7, "log": "",
            "address": "127.0.0.1:1", "marker": "omniflow_services.coordinator"}  # fmt: skip
    state = {"procs": [dead], "env": {}, "supervisor": 0}
    (folder / "state.json").write_text(json.dumps(state))


def _cli(module: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_cli_with_an_address_ignores_a_stale_secured_run_folder(cluster, tmp_path: Path) -> None:
    procs = cluster({"llm": 1})
    addr = procs["coordinator"].address
    run_dir = tmp_path / "stale-run"
    _stale_secured_run_folder(run_dir)
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(run_dir)}
    for var in ("OMNIFLOW_TLS", "OMNIFLOW_TOKEN", "OMNIFLOW_COORDINATOR_ADDR"):
        env.pop(var, None)
    example = Path(__file__).resolve().parents[2] / "examples" / "workflows" / "switch.py"
    # The address as a flag (omniflow ...) and as OMNIFLOW_COORDINATOR_ADDR (the module CLI).
    flag = _cli(
        "omniflow.cli.main", ["workflow", "register", str(example), "--coordinator", addr], env
    )
    assert flag.returncode == 0, flag.stdout + flag.stderr
    listed = _cli(
        "omniflow.cli.workflow", ["workflow", "list"], {**env, "OMNIFLOW_COORDINATOR_ADDR": addr}
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert listed.stdout.startswith("route\tv1"), listed.stdout


def test_client_json_without_a_recorded_topology_is_not_taken(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    _stale_secured_run_folder(folder)
    (folder / "state.json").unlink()  # `down` ran, or the state was removed
    assert (folder / "pki" / "client.json").is_file()
    env_tls = os.environ.pop("OMNIFLOW_TLS", None)
    try:
        assert not local_security.use_local_security(folder)
    finally:
        if env_tls is not None:
            os.environ["OMNIFLOW_TLS"] = env_tls


def test_tests_do_not_read_the_users_run_folder() -> None:
    here = Path(os.environ["OMNIFLOW_RUN_DIR"])
    assert here.is_absolute() and not here.is_relative_to(Path.cwd())
    assert here != Path(".omniflow/run").resolve()
