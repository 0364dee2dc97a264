"""A Redis Sentinel failover under a secured `omniflow up` topology: a master, a replica and
three Sentinels (real redis-server processes, `--sentinel`); every service reaches Redis
through a ``redis+sentinel://`` URL. The master is SIGKILLed; the Sentinels promote the
replica, and without any manual step the services keep working: a workflow registered
before the failover is still there, its run record too, and new runs succeed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.client import Client
from omniflow.dsl import VType, Workflow
from omniflow.errors import OmniflowError
from omniflow.security.local import local_client

pytestmark = pytest.mark.integration

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))
MASTER = "omniflow-test"
PASSWORD = "sentinel-test-" + os.urandom(6).hex()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: object, timeout_s: float, what: str) -> object:
    end = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < end:
        try:
            last = check()  # type: ignore[operator]
            if last:
                return last
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s:.0f} s (last: {last!r})")


class RedisSet:
    """Master, replica and three Sentinels in ``root``; ended by PID in :meth:`stop`."""

    def __init__(self, root: Path, binary: Path) -> None:
        self.root, self.binary = root, binary
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports = {"master": _port(), "replica": _port()}
        self.sentinels = [_port() for _ in range(3)]

    def _spawn(self, name: str, args: list[str]) -> None:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "redis.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [str(self.binary), *args], cwd=folder, stdout=log, stderr=subprocess.STDOUT
            )

    def start(self) -> None:
        auth = ["--requirepass", PASSWORD, "--masterauth", PASSWORD, "--save", "",
                "--appendonly", "no", "--bind", "127.0.0.1"]  # fmt: skip
        self._spawn("master", ["--port", str(self.ports["master"]), *auth])
        self._spawn(
            "replica",
            ["--port", str(self.ports["replica"]), *auth,
             "--replicaof", "127.0.0.1", str(self.ports["master"])],
        )  # fmt: skip
        for i, port in enumerate(self.sentinels):
            folder = self.root / f"sentinel-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            conf = folder / "sentinel.conf"  # Sentinel rewrites its own file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.ports['master']} 2\n"
                f"sentinel auth-pass {MASTER} {PASSWORD}\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
            )
            self._spawn(f"sentinel-{i}", [str(conf), "--sentinel"])
        replica = self.client("replica")
        _wait(lambda: replica.info("replication").get("master_link_status") == "up", 20,
              "the replica in sync")  # fmt: skip
        for port in self.sentinels:
            s = redis.Redis(port=port, socket_timeout=2)
            _wait(lambda s=s: s.sentinel_master(MASTER).get("num-other-sentinels") == 2, 30,
                  "the Sentinels to know each other")  # fmt: skip
            s.close()

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], password=PASSWORD, socket_timeout=2)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis+sentinel://:{PASSWORD}@{hosts}/{MASTER}/0"

    def master_port(self) -> int:
        s = redis.Redis(port=self.sentinels[0], socket_timeout=2)
        try:
            return int(s.sentinel_get_master_addr_by_name(MASTER)[1])
        finally:
            s.close()

    def synced(self) -> bool:
        """Every write of the master has reached the replica."""
        master = self.client("master").info("replication")
        replica = self.client("replica").info("replication")
        return int(replica.get("slave_repl_offset", -1)) >= int(master["master_repl_offset"])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cli(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _upper() -> Workflow:
    wf = Workflow("failover-echo")
    wf.output("text", wf.call("g", "llm", "generate", prompt=wf.input("text", VType.TEXT))["text"])
    return wf


@pytest.mark.timeout(300)
def test_services_keep_working_through_a_sentinel_failover(
    tmp_path: Path, redis_binary: Path
) -> None:
    redis_set = RedisSet(tmp_path / "redis", redis_binary)  # its --sentinel mode too
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(run_dir),
        "OMNIFLOW_GATEWAY_PORT": "0",
        "OMNIFLOW_REGISTRATION_TTL_S": "3",
        "OMP_NUM_THREADS": "1",
    }
    for var in ("OMNIFLOW_TLS", "OMNIFLOW_AUTH", "OMNIFLOW_TOKEN", "OMNIFLOW_UP_TLS",
                "OMNIFLOW_COORDINATOR_ADDR"):  # fmt: skip
        env.pop(var, None)
    topology = tmp_path / "topology.yaml"
    topology.write_text("node: sentinel\nworkers:\n  - {role: llm, count: 1, program: echo}\n")
    up_started = False
    try:
        redis_set.start()
        env["OMNIFLOW_REDIS_URL"] = redis_set.url  # every service asks the Sentinels
        up = _cli(["up", "--topology", str(topology)], env)
        up_started = True
        assert up.returncode == 0, up.stdout + up.stderr
        assert redis_set.url.split("@")[0] not in up.stdout  # the password is not printed

        state = json.loads((run_dir / "state.json").read_text())
        coordinator = next(p["address"] for p in state["procs"] if p["name"] == "coordinator")

        async def before() -> str:
            async with Client(coordinator, timeout_s=10, run_dir=run_dir) as c:
                await c.register(_upper())
                result = await c.run("failover-echo", {"text": "before"})
                assert result.ok, result.error
                assert result.outputs["text"] == "echo: before"
                return result.run_id

        with local_client(run_dir):  # up runs mutual TLS + auth: the run folder's client cert
            run_id = asyncio.run(before())
            _wait(redis_set.synced, 20, "replication of the run record")
            old = redis_set.ports["master"]
            redis_set.procs["master"].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            _wait(lambda: redis_set.master_port() == redis_set.ports["replica"], 60,
                  "the Sentinels to promote the replica")  # fmt: skip
            promoted_s = time.monotonic() - killed

            async def after() -> tuple[float, int, list[str]]:
                async with Client(coordinator, timeout_s=10, run_dir=run_dir) as c:
                    end = time.monotonic() + 60
                    while True:  # the first calls may still meet the dead master
                        try:
                            result = await c.run("failover-echo", {"text": "after"})
                            error = result.error
                        except OmniflowError as exc:
                            result, error = None, f"{exc.code_name}: {exc}"
                        if (result is not None and result.ok) or time.monotonic() > end:
                            break
                        await asyncio.sleep(0.5)
                    assert result is not None and result.ok, error
                    assert result.outputs["text"] == "echo: after"
                    took = time.monotonic() - killed
                    record = await c.get_run(run_id)
                    names = [w.name for w in await c.list_workflows()]
                    return took, record.state, names

            took, run_state, names = asyncio.run(after())
        assert old != redis_set.master_port()
        assert names == ["failover-echo"]  # registered before the failover: kept
        assert run_state == cpb.RUN_STATE_SUCCEEDED, run_state  # its record: kept
        print(f"replica promoted {promoted_s:.1f} s after the kill; a run succeeded {took:.1f} s")
        status = _cli(["status"], env, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        if up_started:
            down = _cli(["down"], env)
            assert down.returncode == 0, down.stdout + down.stderr
        redis_set.stop()
