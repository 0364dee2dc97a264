"""A secured topology (mutual TLS and auth ON) of real processes, shared by the module.

Redis with a password; kv-index; kv-agents on node-1 and node-2; a tiny-model llm
worker and an echo TEST worker on node-1; a router; a coordinator. Every process has a
certificate of its own identity from one local CA (``omniflow certs``' code). The test
process holds further identities to act as callers: a plain client (with tenant tokens),
a worker of node-1, a worker of node-2, and a coordinator.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from pki_procs import client_security, pki_procs

from omniflow.localredis import RedisProcess
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.security.bundle import Bundle
from omniflow.security.identity import Identity
from omniflow.security.transport import Security
from omniflow.testing.launch import ServiceProc

NODE1, NODE2 = "node-1", "node-2"

SERVICES = {
    "kv-index": Identity("kv-index", NODE1, "kv-index"),
    "agent-1": Identity("kv-agent", NODE1, "agent-1"),
    "agent-2": Identity("kv-agent", NODE2, "agent-2"),
    "llm-1": Identity("worker", NODE1, "llm-1"),
    "echo-1": Identity("worker", NODE1, "echo-1"),
    "router": Identity("router", NODE1, "router"),
    "coordinator": Identity("coordinator", NODE1, "coordinator"),
}
CALLERS = {
    "client": Identity("client", "laptop", "cli"),
    "worker1": Identity("worker", NODE1, "w-test"),
    "worker2": Identity("worker", NODE2, "w-test2"),
    "coord": Identity("coordinator", NODE1, "coord-test"),
}
GRANTS = {"a": "tenant-a:user", "b": "tenant-b:user", "admin": ":admin"}


@dataclass
class Secured:
    bundle: Bundle
    redis: RedisProcess
    procs: dict[str, ServiceProc]
    tokens: dict[str, str]  # "a", "b", "admin" -> token

    def addr(self, name: str) -> str:
        return self.procs[name].address

    def security(self, caller: str, token: str | None = None) -> Security:
        """Client-side security of a test identity, presenting tenant token ``token``."""
        return client_security(self.bundle, CALLERS[caller], self.tokens[token] if token else "")

    def channel(self, name: str, caller: str = "client", token: str | None = None) -> TracedChannel:
        return open_channel(self.addr(name), security=self.security(caller, token))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    pytest.importorskip("torch", reason="the llm worker of the secured topology needs torch")
    folder = tmp_path_factory.mktemp("secured")
    with pki_procs(folder, SERVICES, list(CALLERS.values()), list(GRANTS.values())) as pki:
        tokens = {k: pki.bundle.tokens[g] for k, g in GRANTS.items()}
        tag = f"h9sec{os.getpid()}"
        start = pki.start
        procs = {"kv-index": start("omniflow_services.kv_index", "kv-index").wait_ready(60)}
        for name in ("agent-1", "agent-2"):
            procs[name] = start(
                "omniflow_services.kv_agent",
                name,
                OMNIFLOW_KV_HOST_BYTES=str(4 * 1024 * 1024),
                OMNIFLOW_KV_SHM_TAG=f"{tag}{name}",
            )
        for name in ("agent-1", "agent-2"):
            procs[name].wait_ready(60)
        procs["llm-1"] = start(
            "omniflow_services.worker",
            "llm-1",
            OMNIFLOW_WORKER_ROLE="llm",
            OMNIFLOW_WORKER_MODEL="tiny:llama",
            OMNIFLOW_MODELS_DIR=str(folder / "models"),
            OMNIFLOW_WORKER_KV_BYTES=str(4 * 1024 * 1024),
            OMNIFLOW_WORKER_TORCH_THREADS="1",
            OMNIFLOW_KV_AGENT_ADDR=procs["agent-1"].address,
        )
        procs["echo-1"] = start(
            "omniflow_services.worker",
            "echo-1",
            OMNIFLOW_WORKER_ENGINE="echo",
            OMNIFLOW_WORKER_ROLE="echo",
        )
        for name in ("llm-1", "echo-1"):
            procs[name].wait_ready(180)
        procs["router"] = start(
            "omniflow_services.router", "router", OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.5"
        ).wait_ready(60)
        procs["coordinator"] = start(
            "omniflow_services.coordinator",
            "coordinator",
            OMNIFLOW_ROUTER_ADDR=procs["router"].address,
        ).wait_ready(60)
        yield Secured(pki.bundle, pki.redis, procs, tokens)
