"""Several nodes on one machine, as real processes, for pipeline tests and benchmarks.

``start_nodes`` starts a private Redis, a kv-index, then per node a kv-agent (its own
shared-memory host tier and SSD file) and that node's workers attached to it, then a
router and a coordinator. Each process gets a node id (``OMNIFLOW_NODE_ID``), so the
router's ``kv_aware`` sees which node's agent holds which pages, and pages move between
nodes agent to agent exactly as between machines. ``Nodes.stop`` ends every process by
PID (``omniflow.testing.launch``: SIGTERM, then SIGKILL), stops the Redis and removes the
agents' shared-memory files.

The services are started as ``python -m omniflow_services.<name>`` subprocesses (this
module imports none of them).
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omniflow.localredis import RedisProcess, start_redis
from omniflow.testing.launch import Launcher

SHM = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker of a node: its instance id (also its name here), role and model."""

    name: str
    role: str
    model: str
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Nodes:
    """The processes of one topology; ``addresses`` by name once each is ready."""

    root: Path
    redis: RedisProcess
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    addresses: dict[str, str] = field(default_factory=dict)
    node_of: dict[str, str] = field(default_factory=dict)  # worker name -> node id
    base_env: dict[str, str] = field(default_factory=dict)
    launcher: Launcher = field(init=False)

    def __post_init__(self) -> None:
        self.launcher = Launcher(self.root, self.redis.url, **self.base_env)

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        """Every process started, by name."""
        return {name: p.popen for name, p in self.launcher.procs.items()}

    def start(self, module: str, name: str, **env: str) -> None:
        """Start ``python -m omniflow_services.<module>`` as ``name`` (not waited for)."""
        self.launcher.service(f"omniflow_services.{module}", name, **env)

    def wait(self, name: str, timeout_s: float = 180.0) -> str:
        """``name``'s address once it wrote its ready file (it is SERVING then)."""
        try:
            self.addresses[name] = self.launcher.procs[name].wait_ready(timeout_s).address
        except AssertionError as exc:
            raise RuntimeError(str(exc)) from None
        return self.addresses[name]

    def log(self, name: str) -> str:
        proc = self.launcher.procs.get(name)
        return proc.tail(4000) if proc is not None else ""

    def stop(self) -> None:
        self.launcher.stop(timeout_s=15)
        self.redis.stop()
        for path in SHM.glob(f"omniflow-*{self.tag}*"):
            path.unlink(missing_ok=True)


def start_nodes(
    root: Path,
    nodes: Mapping[str, list[WorkerSpec]],
    *,
    models_dir: Path,
    redis_binary: Path | None = None,
    env: Mapping[str, str] | None = None,
    router_env: Mapping[str, str] | None = None,
    agent_bytes: int = 64 * 1024 * 1024,
    worker_kv_bytes: int = 32 * 1024 * 1024,
) -> Nodes:
    """Start the topology (every process SERVING when this returns); on a failure, what
    was started is stopped before the error propagates. ``env`` goes to every process."""
    root.mkdir(parents=True, exist_ok=True)
    redis = start_redis(dir=root / "redis", binary=redis_binary)
    n = Nodes(root, redis, base_env={"OMNIFLOW_MODELS_DIR": str(models_dir), **(env or {})})
    try:
        n.start("kv_index", "kv-index")
        index = n.wait("kv-index")
        for node in nodes:
            n.start("kv_agent", f"kv-agent-{node}-{n.tag}", OMNIFLOW_NODE_ID=node,
                    OMNIFLOW_KV_INDEX_ADDR=index, OMNIFLOW_KV_HOST_BYTES=str(agent_bytes),
                    OMNIFLOW_KV_SSD_PATH=str(root / f"ssd-{node}.bin"),
                    OMNIFLOW_KV_SSD_BYTES=str(agent_bytes // 4))  # fmt: skip
        for node in nodes:
            agent = n.wait(f"kv-agent-{node}-{n.tag}")
            n.addresses[f"kv-agent-{node}"] = agent
            for w in nodes[node]:
                n.node_of[w.name] = node
                n.start("worker", w.name, OMNIFLOW_NODE_ID=node, OMNIFLOW_KV_AGENT_ADDR=agent,
                        OMNIFLOW_WORKER_ROLE=w.role, OMNIFLOW_WORKER_MODEL=w.model,
                        OMNIFLOW_WORKER_KV_BYTES=str(worker_kv_bytes), **w.env)  # fmt: skip
        for node in nodes:
            for w in nodes[node]:
                n.wait(w.name, timeout_s=300.0)
        n.start("router", "router", OMNIFLOW_KV_INDEX_ADDR=index,
                OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2",
                # A busy machine: a slow index answer must not turn picks into load-only ones.
                OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S="2", **(router_env or {}))  # fmt: skip
        router = n.wait("router")
        n.start("coordinator", "coordinator", OMNIFLOW_ROUTER_ADDR=router)
        n.wait("coordinator")
    except BaseException:
        n.stop()
        raise
    return n
