"""`omniflow up` runs mutual TLS and auth by default: certificates in the run folder, every
process on TLS with its own identity, the CLI and the supervisor's restarts keep working,
plaintext clients are refused; the gateway's API keys are tenants (runs and cached KV
pages are per tenant). Real processes: echo TEST workers, a tiny llm for the KV test."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import time
from pathlib import Path

import grpc
import httpx
import pytest
from up_procs import check_down, omniflow_cli, procs_by_name

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.client import Client
from omniflow.config import SecuritySettings
from omniflow.dsl import VType, Workflow
from omniflow.rpc.client import check_health, open_channel
from omniflow.security.apikeys import write_keys
from omniflow.security.local import client_settings, local_client
from omniflow.security.transport import Security

pytestmark = pytest.mark.integration

_SECURITY_VARS = (
    "OMNIFLOW_REDIS_URL",
    "OMNIFLOW_TLS",
    "OMNIFLOW_AUTH",
    "OMNIFLOW_TOKEN",
    "OMNIFLOW_UP_TLS",
    "OMNIFLOW_GATEWAY_API_KEYS_FILE",
    "OMNIFLOW_COORDINATOR_ADDR",
)


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
        "OMP_NUM_THREADS": "1",
    }
    for var in _SECURITY_VARS:  # nothing but the default: up secures itself
        env.pop(var, None)
    topology = tmp_path / "topology.yaml"
    topology.write_text("node: sec-node\nworkers:\n  - {role: llm, count: 1, program: echo}\n")
    pids: list[int] = []
    try:
        up = omniflow_cli(["up", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        procs = procs_by_name(run_dir)
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
        status = omniflow_cli(["status"], env)
        assert status.returncode == 0, status.stdout + status.stderr
        asyncio.run(_exercise(run_dir, procs["coordinator"]["address"]))
        # The gateway is one more client under the same rules: its calls go over TLS, and
        # its HTTP side takes the API keys up made.
        url = f"{procs['gateway']['address']}/v1/models"
        assert httpx.get(url, timeout=30).status_code == 401
        key = {"Authorization": f"Bearer {client['gateway_api_key']}"}
        models = httpx.get(url, headers=key, timeout=30)
        assert models.status_code == 200, models.text
        assert models.json()["data"], models.text
        # A crashed router comes back (the supervisor restarts it with its saved env, its
        # certificate included) and serves TLS again.
        os.kill(procs["router"]["pid"], signal.SIGKILL)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            time.sleep(0.5)
            router = procs_by_name(run_dir)["router"]
            back = router["pid"] != procs["router"]["pid"]
            if back and omniflow_cli(["status"], env).returncode == 0:
                break
        else:
            raise AssertionError(f"router not back:\n{omniflow_cli(['status'], env).stdout}")
        pids.append(router["pid"])
    finally:
        down = omniflow_cli(["down"], env)
    check_down(down, pids)


def _completion(base: str, key: str, prompt: list[int]) -> dict:
    reply = httpx.post(
        f"{base}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": _served_model(base, key), "prompt": prompt, "max_tokens": 1,
              "temperature": 0.0},
        timeout=120,
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.json()


def _served_model(base: str, key: str) -> str:
    listed = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    return next(m["id"] for m in listed.json()["data"] if not m["id"].startswith("workflow:"))


def _cached(reply: dict) -> int:
    return int((reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def _owners(redis_url: str) -> dict[str, str]:
    import redis.asyncio as aioredis

    db = aioredis.from_url(redis_url, socket_timeout=5)
    try:
        keys = [k async for k in db.scan_iter("omniflow:tenant:run:*")]
        values = await db.mget(keys) if keys else []
        pairs = zip(keys, values, strict=True)
        return {k.decode().rsplit(":", 1)[-1]: v.decode() for k, v in pairs if v}
    finally:
        await db.aclose()


async def _get_run(run_dir: Path, coordinator: str, run_id: str, token_key: str) -> grpc.StatusCode:
    admin = client_settings(run_dir)
    assert admin is not None
    token = json.loads((run_dir / "pki" / "client.json").read_text())[token_key]
    sec = Security.load(
        SecuritySettings(
            tls="on", tls_ca=admin.tls_ca, tls_cert=admin.tls_cert, tls_key=admin.tls_key,
            token=token,
        )
    )  # fmt: skip
    async with open_channel(coordinator, security=sec, default_timeout_s=30) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        try:
            await stub.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id))
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.usefixtures("redis_binary")
def test_gateway_api_keys_are_tenants(tmp_path: Path) -> None:
    """Two API keys of two tenants: each one's cached prompt is a hit for itself only
    (cached_tokens 0 for the other), and a run made through one tenant's key is that
    tenant's (NOT_FOUND for another tenant's token, visible to an admin)."""
    run_dir = tmp_path / "run"
    keys = {"a": "key-a-" + os.urandom(12).hex(), "b": "key-b-" + os.urandom(12).hex()}
    keys_file = tmp_path / "keys.json"
    write_keys(keys_file, [{"key": keys["a"], "tenant": "tenant-a"},
                           {"key": keys["b"], "tenant": "tenant-b"}])  # fmt: skip
    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(run_dir),
        "OMNIFLOW_MODELS_DIR": str(tmp_path / "models"),
        "OMNIFLOW_GATEWAY_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }
    for var in _SECURITY_VARS:
        env.pop(var, None)
    env["OMNIFLOW_GATEWAY_API_KEYS_FILE"] = str(keys_file)  # the operator's own key table
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        "node: sec-kv\nworkers:\n"
        '  - {role: llm, count: 1, model: "tiny:qwen2", env: {OMNIFLOW_WORKER_KV_BYTES: "8388608",'
        ' OMNIFLOW_WORKER_TORCH_THREADS: "1"}}\n'
    )
    pids: list[int] = []
    try:
        up = omniflow_cli(["up", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        procs = procs_by_name(run_dir)
        pids = [p["pid"] for p in procs.values()]
        base = procs["gateway"]["address"]
        prompt = [(7 * i + 3) % 200 + 10 for i in range(64)]  # 4 pages of 16 tokens
        first_a = _completion(base, keys["a"], prompt)
        again_a = _completion(base, keys["a"], prompt)
        first_b = _completion(base, keys["b"], prompt)
        again_b = _completion(base, keys["b"], prompt)
        assert _cached(first_a) == 0, first_a["usage"]
        assert _cached(again_a) > 0, again_a["usage"]  # tenant A's pages are a hit for A
        assert _cached(first_b) == 0, first_b["usage"]  # ... and nothing for B
        assert _cached(again_b) > 0, again_b["usage"]  # B's own pages are B's hit
        assert first_a["choices"][0]["text"] == first_b["choices"][0]["text"]  # same model

        # A workflow (registered by the admin: everyone's) run through A's key is A's run.
        wf = Workflow("tenant-echo")
        wf.output(
            "text",
            wf.call("g", "llm", "generate", prompt=wf.input("question", VType.TEXT),
                    params={"max_tokens": 2, "temperature": 0.0})["text"],
        )  # fmt: skip
        coordinator = procs["coordinator"]["address"]

        async def register() -> None:
            async with Client(coordinator, run_dir=run_dir) as c:
                await c.register(wf)

        with local_client(run_dir):
            asyncio.run(register())
        chat = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {keys['a']}"},
            json={"model": "workflow:tenant-echo",
                  "messages": [{"role": "user", "content": "hello"}]},
            timeout=120,
        )  # fmt: skip
        assert chat.status_code == 200, chat.text
        redis_url = json.loads((run_dir / "state.json").read_text())["env"]["OMNIFLOW_REDIS_URL"]
        owners = asyncio.run(_owners(redis_url))
        runs_of_a = [r for r, t in owners.items() if t == "tenant-a"]
        assert len(runs_of_a) == 1, owners
        other = asyncio.run(_get_run(run_dir, coordinator, runs_of_a[0], "user_token"))
        assert other == grpc.StatusCode.NOT_FOUND  # tenant "local" cannot see A's run
        admin = asyncio.run(_get_run(run_dir, coordinator, runs_of_a[0], "OMNIFLOW_TOKEN"))
        assert admin == grpc.StatusCode.OK
    finally:
        down = omniflow_cli(["down"], env)
    check_down(down, pids)


@pytest.mark.usefixtures("redis_binary")
def test_up_insecure_is_plaintext_and_says_so(tmp_path: Path) -> None:
    """`omniflow up --insecure` (development): plaintext, no tokens, no API keys."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(run_dir), "OMNIFLOW_GATEWAY_PORT": "0",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    for var in _SECURITY_VARS:
        env.pop(var, None)
    topology = tmp_path / "topology.yaml"
    topology.write_text("node: plain\nworkers:\n  - {role: llm, count: 1, program: echo}\n")
    pids: list[int] = []
    try:
        up = omniflow_cli(["up", "--insecure", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "PLAINTEXT" in up.stdout and "development only" in up.stdout
        procs = procs_by_name(run_dir)
        pids = [p["pid"] for p in procs.values()]
        assert not (run_dir / "pki" / "client.json").exists()
        assert all("OMNIFLOW_TLS" not in p["env"] for p in procs.values())
        plain = Security.load(SecuritySettings())
        assert asyncio.run(check_health(procs["coordinator"]["address"], security=plain)) == (
            "SERVING"
        )
        models = httpx.get(f"{procs['gateway']['address']}/v1/models", timeout=30)
        assert models.status_code == 200, models.text  # no key asked for
        assert omniflow_cli(["status"], env).returncode == 0
    finally:
        down = omniflow_cli(["down"], env)
    check_down(down, pids)
