"""Fixtures for Control Flow tests: real router, coordinator and echo TEST worker
processes on a private Redis, and a client of the coordinator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from omniflow.localredis import LocalRedisError, RedisProcess, find_redis_server, start_redis


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    ready_file: Path
    log: Path
    address: str = ""

    def wait_ready(self, timeout_s: float = 30.0) -> Proc:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.popen.returncode}:\n{self.tail()}")
            if self.ready_file.exists():
                self.address = json.loads(self.ready_file.read_text())["address"]
                return self
            time.sleep(0.05)
        raise AssertionError(f"{self.name} not ready after {timeout_s}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no deregistration, no goodbye."""
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProcess]:
    try:
        binary = find_redis_server()
    except LocalRedisError as exc:
        pytest.skip(f"needs a redis-server: {exc}")
    server = start_redis(dir=tmp_path / "redis", binary=binary)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def launch(tmp_path: Path, redis_proc: RedisProcess) -> Iterator[Callable[..., Proc]]:
    """Start ``python -m <module>`` with env on the private Redis; all ended at teardown."""
    started: list[Proc] = []

    def start(module: str, name: str, **env: str) -> Proc:
        ready = tmp_path / f"{name}.ready.json"
        log = tmp_path / f"{name}.log"
        full_env = {
            **os.environ,
            "OMNIFLOW_REDIS_URL": redis_proc.url,
            "OMNIFLOW_DISCOVERY": "redis",
            "OMNIFLOW_PORT": "0",
            "OMNIFLOW_METRICS_PORT": "-1",
            "OMNIFLOW_READY_FILE": str(ready),
            "OMNIFLOW_INSTANCE_ID": name,
            "OMNIFLOW_REGISTRATION_TTL_S": "2",
            "OMNIFLOW_LOG_LEVEL": "INFO",
            **env,
        }
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", module],
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        proc = Proc(name, popen, ready, log)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


ECHO = "omniflow.testing.echo_worker"
ROUTER = "omniflow_services.router"
COORDINATOR = "omniflow_services.coordinator"


@pytest.fixture
def cluster(launch: Callable[..., Proc]) -> Callable[..., dict[str, Proc]]:
    """``cluster(workers={"llm": 2, "echo": 1}, coordinator_env={...})``: router,
    coordinator and echo test workers, all SERVING."""

    def make(
        workers: dict[str, int] | None = None,
        coordinator_env: dict[str, str] | None = None,
        worker_env: dict[str, str] | None = None,
        router_env: dict[str, str] | None = None,
    ) -> dict[str, Proc]:
        procs: dict[str, Proc] = {}
        for role, count in ({"llm": 2} if workers is None else workers).items():
            for i in range(count):
                name = f"{role}-{i}"
                env = {"OMNIFLOW_WORKER_ROLE": role, **(worker_env or {})}
                procs[name] = launch(ECHO, name, **env)
        for proc in procs.values():
            proc.wait_ready()
        env = {
            "OMNIFLOW_ROUTER_HEALTH_INTERVAL_S": "0.2",
            "OMNIFLOW_ROUTER_BREAKER_COOLDOWN_S": "30",
            **(router_env or {}),
        }
        procs["router"] = launch(ROUTER, "router", **env).wait_ready()
        procs["coordinator"] = launch(
            COORDINATOR,
            "coordinator",
            OMNIFLOW_ROUTER_ADDR=procs["router"].address,
            **(coordinator_env or {}),
        ).wait_ready()
        return procs

    return make
