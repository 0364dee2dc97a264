"""Fixtures for multi-process service tests: real service processes on a private Redis."""

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
class ServiceProc:
    name: str
    popen: subprocess.Popen[bytes]
    ready_file: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def ready(self) -> dict:
        return json.loads(self.ready_file.read_text())

    def wait_ready(self, timeout_s: float = 30.0) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.popen.returncode}:\n{self.tail()}")
            if self.ready_file.exists():
                return self.ready()
            time.sleep(0.05)
        raise AssertionError(f"{self.name} not ready after {timeout_s}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A Redis of this test alone, so that discovery listings see only its services."""
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
def spawn(tmp_path: Path, private_redis: RedisProcess) -> Iterator[Callable[..., ServiceProc]]:
    """Start ``python -m omniflow_services.<module>`` with env; every one is ended at teardown."""
    started: list[ServiceProc] = []

    def start(module: str, name: str | None = None, **env: str) -> ServiceProc:
        name = name or module
        ready = tmp_path / f"{name}.ready.json"
        log = tmp_path / f"{name}.log"
        full_env = {
            **os.environ,
            "OMNIFLOW_REDIS_URL": private_redis.url,
            "OMNIFLOW_DISCOVERY": "redis",
            "OMNIFLOW_PORT": "0",
            "OMNIFLOW_METRICS_PORT": "-1",
            "OMNIFLOW_READY_FILE": str(ready),
            "OMNIFLOW_INSTANCE_ID": name,
            **env,
        }
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", f"omniflow_services.{module}"],
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        proc = ServiceProc(name, popen, ready, log)
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
