"""Fixtures for Control Flow tests: real router, coordinator and echo TEST worker
processes on a private Redis, and a client of the coordinator."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omniflow.localredis import RedisProcess
from omniflow.testing.launch import ServiceProc

# ``launch`` and ``private_redis`` come from tests/conftest.py.
Proc = ServiceProc


@pytest.fixture
def redis_proc(private_redis: RedisProcess) -> RedisProcess:
    return private_redis


ECHO = "omniflow_services.worker"  # with the echo engine (OMNIFLOW_WORKER_ENGINE=echo)
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
                env = {
                    "OMNIFLOW_WORKER_ROLE": role,
                    "OMNIFLOW_WORKER_ENGINE": "echo",
                    **(worker_env or {}),
                }
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
