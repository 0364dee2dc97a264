"""Shared by the control benchmarks: a private Redis and real service processes
(router, coordinator, echo TEST workers), ended by PID when the bench finishes."""

from __future__ import annotations

import tempfile
from pathlib import Path

from omniflow.localredis import RedisProcess, start_redis
from omniflow.testing.launch import Launcher


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Procs:
    """Processes of one bench run on a private Redis."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="omniflow-bench-"))
        self.redis: RedisProcess = start_redis(dir=self.dir / "redis")
        self.launcher = Launcher(self.dir, self.redis.url, OMNIFLOW_LOG_LEVEL="WARNING")

    def start(self, module: str, name: str, **env: str) -> str:
        """Start ``python -m module``; returns its address once it is SERVING."""
        proc = self.launcher.service(module, name, **env)
        try:
            proc.wait_ready(60)
        except AssertionError:
            raise RuntimeError(f"{name} did not start; see {proc.log}") from None
        return proc.address

    def worker(self, name: str, role: str, **env: str) -> str:
        return self.start(
            "omniflow_services.worker",
            name,
            OMNIFLOW_WORKER_ENGINE="echo",
            OMNIFLOW_WORKER_ROLE=role,
            **env,
        )

    def close(self) -> None:
        self.launcher.stop()
        self.redis.stop()
