"""Shared by the control benchmarks: a private Redis and real service processes
(router, coordinator, echo TEST workers), ended by PID when the bench finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omniflow.localredis import RedisProcess, start_redis


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Procs:
    """Processes of one bench run on a private Redis."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="omniflow-bench-"))
        self.redis: RedisProcess = start_redis(dir=self.dir / "redis")
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, module: str, name: str, **env: str) -> str:
        """Start ``python -m module``; returns its address once it is SERVING."""
        ready = self.dir / f"{name}.ready"
        full = {
            **os.environ,
            "OMNIFLOW_REDIS_URL": self.redis.url,
            "OMNIFLOW_DISCOVERY": "redis",
            "OMNIFLOW_PORT": "0",
            "OMNIFLOW_METRICS_PORT": "-1",
            "OMNIFLOW_READY_FILE": str(ready),
            "OMNIFLOW_INSTANCE_ID": name,
            "OMNIFLOW_LOG_LEVEL": "WARNING",
            **env,
        }
        with open(self.dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", module], env=full, stdout=log, stderr=subprocess.STDOUT
            )
        self.started.append(proc)
        end = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{name} did not start; see {self.dir / (name + '.log')}")
            time.sleep(0.05)
        return str(json.loads(ready.read_text())["address"])

    def worker(self, name: str, role: str, **env: str) -> str:
        return self.start(
            "omniflow_services.worker",
            name,
            OMNIFLOW_WORKER_ENGINE="echo",
            OMNIFLOW_WORKER_ROLE=role,
            **env,
        )

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop()
