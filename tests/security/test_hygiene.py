"""The front door's hygiene on one secured `omniflow up` (real processes; a tiny llm worker):
the run folder is 0700 and every file 0600 under a loose umask; `omniflow api-key` reads
the running topology; the gateway's access log and the coordinator's failed-run log; a
token or API key removed from its file stops working within 5 s, and both can expire;
`omniflow certs rotate` renews every certificate while requests keep flowing (none lost,
new handshakes present the new certificate); `down` leaves no credentials a client would
take."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from pki_procs import served_certificate

from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.client import Client
from omniflow.config import SecuritySettings
from omniflow.dsl import VType, Workflow
from omniflow.rpc.client import open_channel
from omniflow.security.apikeys import write_keys
from omniflow.security.identity import write_tokens
from omniflow.security.local import client_settings, use_local_security
from omniflow.security.transport import Security

pytestmark = pytest.mark.integration

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))
_CLEARED = (
    "OMNIFLOW_REDIS_URL", "OMNIFLOW_TLS", "OMNIFLOW_AUTH", "OMNIFLOW_TOKEN", "OMNIFLOW_UP_TLS",
    "OMNIFLOW_GATEWAY_API_KEYS_FILE", "OMNIFLOW_COORDINATOR_ADDR",
)  # fmt: skip
WITHIN_S = 5.0  # a removed token or key stops working within this


class Up:
    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir, self.env = run_dir, env

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [OMNIFLOW, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    @property
    def procs(self) -> dict[str, dict]:
        state = json.loads((self.run_dir / "state.json").read_text())
        return {p["name"]: p for p in state["procs"]}

    @property
    def pki(self) -> Path:
        return self.run_dir / "pki"

    @property
    def client(self) -> dict:
        return json.loads((self.pki / "client.json").read_text())

    @property
    def gateway(self) -> str:
        return self.procs["gateway"]["address"]

    @functools.cached_property
    def model(self) -> str:
        """The llm the gateway serves (not a workflow)."""
        headers = {"Authorization": f"Bearer {self.client['gateway_admin_key']}"}
        listed = httpx.get(f"{self.gateway}/v1/models", headers=headers, timeout=30).json()
        return next(m["id"] for m in listed["data"] if not m["id"].startswith("workflow:"))

    @property
    def coordinator(self) -> str:
        return self.procs["coordinator"]["address"]

    def security(self, token: str) -> Security:
        admin = client_settings(self.run_dir)
        assert admin is not None
        return Security.load(
            SecuritySettings(
                tls="on", tls_ca=admin.tls_ca, tls_cert=admin.tls_cert, tls_key=admin.tls_key,
                token=token,
            )
        )  # fmt: skip


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[Up]:
    pytest.importorskip("torch", reason="the tiny llm worker needs torch")
    tmp = tmp_path_factory.mktemp("hygiene")
    run_dir = tmp / "run"
    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(run_dir),
        "OMNIFLOW_MODELS_DIR": str(tmp / "models"),
        "OMNIFLOW_GATEWAY_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }
    for var in _CLEARED:
        env.pop(var, None)
    topology = tmp / "topology.yaml"
    topology.write_text(
        "node: hyg-node\nworkers:\n"
        '  - {role: llm, count: 1, model: "tiny:qwen2", env: {OMNIFLOW_WORKER_KV_BYTES: "8388608",'
        ' OMNIFLOW_WORKER_TORCH_THREADS: "1"}}\n'
    )
    topo = Up(run_dir, env)
    # A loose umask, as a user's shell may have: nothing in the run folder may follow it.
    started = subprocess.run(
        [OMNIFLOW, "up", "--topology", str(topology)],
        env=env, capture_output=True, text=True, timeout=300, umask=0o022,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield topo
    finally:
        down = topo.cli("down")
        assert down.returncode == 0, down.stdout + down.stderr


def _completion(up: Up, key: str, request_id: str = "") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if request_id:
        headers["x-request-id"] = request_id
    return httpx.post(
        f"{up.gateway}/v1/completions",
        headers=headers,
        json={"model": up.model, "prompt": [11, 12, 13, 14, 15], "max_tokens": 3,
              "temperature": 0.0},
        timeout=120,
    )  # fmt: skip


def _models(up: Up, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{up.gateway}/v1/models", headers=headers, timeout=30).status_code


async def _list(up: Up, token: str) -> grpc.StatusCode:
    async with open_channel(up.coordinator, security=up.security(token)) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        try:
            await stub.ListWorkflows(coordinator_pb2.ListWorkflowsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _until(check, want, within_s: float) -> float:
    """Seconds until ``check()`` returns ``want`` (AssertionError past ``within_s``)."""
    start = time.monotonic()
    while True:
        got = check()
        if got == want:
            return time.monotonic() - start
        if time.monotonic() - start > within_s:
            raise AssertionError(f"still {got!r} after {within_s} s (want {want!r})")
        time.sleep(0.2)


def test_run_folder_is_private_whatever_the_umask(up: Up) -> None:
    assert _completion(up, up.client["gateway_api_key"]).status_code == 200  # logs, AOF written
    time.sleep(1.5)  # Redis fsyncs its append-only file every second
    loose = []
    for path in [up.run_dir, *up.run_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        want = 0o700 if path.is_dir() else 0o600
        if mode != want:
            loose.append(f"{path.relative_to(up.run_dir)}: {oct(mode)}")
    assert not loose, loose
    names = {p.name for p in up.run_dir.rglob("*")}
    assert any(n.startswith("appendonly") for n in names), sorted(names)  # Redis's AOF
    assert {"gateway.log", "gateway.json", "ca.key", "client.json"} <= names, sorted(names)


def test_api_key_comes_from_the_running_topology(up: Up) -> None:
    user, admin = up.cli("api-key"), up.cli("api-key", "--admin")
    assert user.returncode == 0 and admin.returncode == 0, user.stderr + admin.stderr
    assert user.stdout.strip() == up.client["gateway_api_key"]
    assert admin.stdout.strip() == up.client["gateway_admin_key"]


def test_access_log_has_one_line_per_request(up: Up) -> None:
    rid = "hyg-" + os.urandom(6).hex()
    reply = _completion(up, up.client["gateway_api_key"], rid)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    refused = "hyg-401-" + os.urandom(6).hex()
    httpx.get(f"{up.gateway}/v1/models", headers={"x-request-id": refused}, timeout=30)
    log = up.run_dir / "logs" / "gateway.log"

    def lines() -> list[str]:
        text = log.read_text(errors="replace")
        return [ln for ln in text.splitlines() if f"id={rid}" in ln or f"id={refused}" in ln]

    _until(lambda: len(lines()), 2, 10)
    ok, bad = sorted(lines(), key=lambda ln: refused in ln)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert (
        f"POST /v1/completions 200 tenant=local prompt_tokens={usage['prompt_tokens']} "
        f"completion_tokens={usage['completion_tokens']} cached_tokens={cached} ms="
    ) in ok, ok
    assert usage["completion_tokens"] == 3
    assert "GET /v1/models 401 tenant=- prompt_tokens=0" in bad, bad


def test_failed_run_is_logged_with_its_node(up: Up) -> None:
    wf = Workflow("hyg-fail")
    # An empty prompt: the worker refuses it (INVALID_ARGUMENT), the node fails for good.
    wf.output("y", wf.call("boom", "llm", "generate", prompt=wf.input("x", VType.TEXT))["text"])

    async def run() -> str:
        async with Client(up.coordinator, run_dir=up.run_dir) as client:
            await client.register(wf)
            result = await client.run("hyg-fail", {"x": ""})
        assert result.state == "failed" and "boom" in result.error, result
        return result.run_id

    run_id = asyncio.run(run())
    log = up.run_dir / "logs" / "coordinator.log"
    want = f"run {run_id} (workflow hyg-fail v"

    def logged() -> list[str]:
        return [ln for ln in log.read_text(errors="replace").splitlines() if want in ln]

    _until(lambda: bool(logged()), True, 10)
    assert "failed at node boom:" in logged()[0], logged()


def test_removed_token_stops_working_and_tokens_expire(up: Up) -> None:
    tokens_file = up.pki / "tokens.json"
    original = json.loads(tokens_file.read_text())["tokens"]
    user, admin = up.client["user_token"], up.client["OMNIFLOW_TOKEN"]
    assert asyncio.run(_list(up, user)) == grpc.StatusCode.OK
    try:
        write_tokens(tokens_file, [e for e in original if e["token"] != user])
        took = _until(lambda: asyncio.run(_list(up, user)), grpc.StatusCode.UNAUTHENTICATED, 8)
        assert took <= WITHIN_S, took
        assert asyncio.run(_list(up, admin)) == grpc.StatusCode.OK
        # A token with an expiry works until then, and not after.
        brief = "brief-" + os.urandom(12).hex()
        ends = time.time() + 4.0
        entry = {"token": brief, "tenant": "local", "roles": ["user"], "expires_at": ends}
        write_tokens(tokens_file, [*original, entry])
        _until(lambda: asyncio.run(_list(up, brief)), grpc.StatusCode.OK, WITHIN_S)
        assert time.time() < ends
        _until(lambda: asyncio.run(_list(up, brief)), grpc.StatusCode.UNAUTHENTICATED, 8)
        assert time.time() >= ends
    finally:
        write_tokens(tokens_file, original)
    _until(lambda: asyncio.run(_list(up, user)), grpc.StatusCode.OK, WITHIN_S)


def test_removed_api_key_stops_working_and_keys_expire(up: Up) -> None:
    keys_file = up.pki / "gateway-keys.json"
    original = json.loads(keys_file.read_text())["keys"]
    user, admin = up.client["gateway_api_key"], up.client["gateway_admin_key"]
    assert _models(up, user) == 200
    try:
        write_keys(keys_file, [e for e in original if e["key"] != user])
        took = _until(lambda: _models(up, user), 401, 8)
        assert took <= WITHIN_S, took
        assert _models(up, admin) == 200
        brief = "brief-" + os.urandom(12).hex()
        ends = time.time() + 4.0
        write_keys(keys_file, [*original, {"key": brief, "tenant": "t2", "expires_at": ends}])
        _until(lambda: _models(up, brief), 200, WITHIN_S)
        _until(lambda: _models(up, brief), 401, 8)
        assert time.time() >= ends
    finally:
        write_keys(keys_file, original)
    _until(lambda: _models(up, user), 200, WITHIN_S)


def _served_serial(address: str, up: Up) -> int:
    """The serial of the certificate a new TLS handshake with ``address`` presents."""
    record = up.client
    return served_certificate(
        address,
        Path(record["OMNIFLOW_TLS_CA"]),
        Path(record["OMNIFLOW_TLS_CERT"]),
        Path(record["OMNIFLOW_TLS_KEY"]),
    ).serial_number


def test_certs_rotate_loses_no_request(up: Up) -> None:
    before = {n: _served_serial(up.procs[n]["address"], up) for n in ("coordinator", "router")}
    errors: list[str] = []
    counts = {"grpc": 0, "http": 0}
    stop = threading.Event()
    admin = up.client["OMNIFLOW_TOKEN"]
    key = up.client["gateway_api_key"]

    def grpc_traffic() -> None:
        async def loop() -> None:
            # One long-lived channel and a new one (a new handshake) per call.
            async with open_channel(up.coordinator, security=up.security(admin)) as kept:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(kept)
                while not stop.is_set():
                    try:
                        await stub.ListWorkflows(coordinator_pb2.ListWorkflowsRequest(), timeout=10)
                        code = await _list(up, admin)
                        if code != grpc.StatusCode.OK:
                            errors.append(f"new channel: {code}")
                        counts["grpc"] += 1
                    except grpc.aio.AioRpcError as exc:
                        errors.append(f"kept channel: {exc.code()} {exc.details()}")

        asyncio.run(loop())

    def http_traffic() -> None:  # gateway -> router -> worker, all over mutual TLS
        while not stop.is_set():
            reply = _completion(up, key)
            if reply.status_code != 200:
                errors.append(f"gateway: {reply.status_code} {reply.text[:200]}")
            counts["http"] += 1

    threads = [threading.Thread(target=grpc_traffic), threading.Thread(target=http_traffic)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        rotated = up.cli("certs", "rotate")
        assert rotated.returncode == 0, rotated.stdout + rotated.stderr
        renewed = json.loads(rotated.stdout)["renewed"]
        assert any("/coordinator" in u for u in renewed) and any("/client/" in u for u in renewed)
        time.sleep(3.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors[:5]
    assert counts["grpc"] > 0 and counts["http"] > 0, counts
    after = {n: _served_serial(up.procs[n]["address"], up) for n in before}
    assert all(after[n] != before[n] for n in before), (before, after)
    # The renewed files are what the pki folder holds now, and they are served.
    pem = (up.pki / Path(up.procs["coordinator"]["env"]["OMNIFLOW_TLS_CERT"]).name).read_bytes()
    assert x509.load_pem_x509_certificate(pem).serial_number == after["coordinator"]
    assert asyncio.run(_list(up, admin)) == grpc.StatusCode.OK


def test_down_leaves_no_credentials_for_a_client(up: Up) -> None:
    saved = up.client  # what a topology killed without `down` leaves behind
    down = up.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (up.pki / "client.json").exists()
    assert up.cli("api-key").returncode == 1
    # A client.json with no recorded topology beside it (processes killed, state gone) is
    # not taken: a client would fail every handshake with a plaintext topology.
    (up.pki / "client.json").write_text(json.dumps(saved))
    assert not use_local_security(up.run_dir)
