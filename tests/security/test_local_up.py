"""`omniflow up` with mutual TLS and auth (OMNIFLOW_UP_TLS=on): certificates in the run
folder, every process on TLS with its own identity, the CLI and the supervisor's restarts
keep working, plaintext clients are refused. Real processes, echo TEST workers."""

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

import grpc
import httpx
import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.config import SecuritySettings
from omniflow.dsl import VType, Workflow
from omniflow.rpc.client import check_health, open_channel
from omniflow.security.local import client_settings
from omniflow.security.transport import Security

pytestmark = pytest.mark.integration

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))


def _run(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _procs(run_dir: Path) -> dict[str, dict]:
    return {p["name"]: p for p in json.loads((run_dir / "state.json").read_text())["procs"]}


async def _exercise(run_dir: Path, coordinator: str) -> None:
    request = coordinator_pb2.ListWorkflowsRequest()
    async with grpc.aio.insecure_channel(coordinator) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListWorkflows(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    admin = client_settings(run_dir)
    assert admin is not None
    user_token = json.loads((run_dir / "pki" / "client.json").read_text())["user_token"]
    user = Security.load(
        SecuritySettings(
            tls="on",
            tls_ca=admin.tls_ca,
            tls_cert=admin.tls_cert,
            tls_key=admin.tls_key,
            token=user_token,
        )
    )
    assert await check_health(coordinator, security=user) == "SERVING"
    wf = Workflow("up-upper")
    wf.output("text", wf.call("g", "llm", "generate", prompt=wf.input("text", VType.TEXT))["text"])
    async with open_channel(coordinator, security=user, default_timeout_s=60) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        await stub.RegisterWorkflow(coordinator_pb2.RegisterWorkflowRequest(graph=wf.compile()))
        submit = coordinator_pb2.SubmitRunRequest(
            workflow="up-upper", inputs={"text": common_pb2.Value(text="tls")}
        )
        events = [e async for e in stub.RunWorkflow(submit)]
        run = (await stub.GetRun(coordinator_pb2.GetRunRequest(run_id=events[-1].run_id))).run
    assert run.outputs["text"].text == "echo: tls"  # the echo worker's answer


@pytest.mark.usefixtures("redis_binary")
def test_up_with_tls_and_auth(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(run_dir),
        "OMNIFLOW_GATEWAY_PORT": "0",
        "OMNIFLOW_UP_TLS": "on",
        "OMP_NUM_THREADS": "1",
    }
    for var in ("OMNIFLOW_REDIS_URL", "OMNIFLOW_TLS", "OMNIFLOW_AUTH", "OMNIFLOW_TOKEN"):
        env.pop(var, None)
    topology = tmp_path / "topology.yaml"
    topology.write_text("node: sec-node\nworkers:\n  - {role: llm, count: 1, program: echo}\n")
    pids: list[int] = []
    try:
        up = _run(["up", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        procs = _procs(run_dir)
        pids = [p["pid"] for p in procs.values()]
        pki = run_dir / "pki"
        for name, p in procs.items():
            if name == "redis":
                continue
            assert p["env"]["OMNIFLOW_TLS"] == "on" and p["env"]["OMNIFLOW_AUTH"] == "on"
            key = Path(p["env"]["OMNIFLOW_TLS_KEY"])
            assert key.parent == pki and stat.S_IMODE(key.stat().st_mode) == 0o600
        state_text = (run_dir / "state.json").read_text()
        client = json.loads((pki / "client.json").read_text())
        assert client["OMNIFLOW_TOKEN"] not in state_text  # tokens stay in 0600 files
        status = _run(["status"], env)
        assert status.returncode == 0, status.stdout + status.stderr
        asyncio.run(_exercise(run_dir, procs["coordinator"]["address"]))
        # The gateway is one more client under the same rules: its calls go over TLS.
        models = httpx.get(f"{procs['gateway']['address']}/v1/models", timeout=30)
        assert models.status_code == 200, models.text
        assert models.json()["data"], models.text
        # A crashed router comes back (the supervisor restarts it with its saved env, its
        # certificate included) and serves TLS again.
        os.kill(procs["router"]["pid"], signal.SIGKILL)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            time.sleep(0.5)
            router = _procs(run_dir)["router"]
            if router["pid"] != procs["router"]["pid"] and _run(["status"], env).returncode == 0:
                break
        else:
            raise AssertionError(f"router not back:\n{_run(['status'], env).stdout}")
        pids.append(router["pid"])
    finally:
        down = _run(["down"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    left = [
        p for p in pids if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert not left, "processes left behind"
