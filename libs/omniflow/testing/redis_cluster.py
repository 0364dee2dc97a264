"""A local Redis Cluster of real ``redis-server --cluster-enabled yes`` processes.

For tests and benches of the KV index on a cluster: ``n`` masters on free loopback ports,
joined by ``redis-cli --cluster create`` (no replicas), ready once every node reports
``cluster_state:ok``; stopped by PID on exit::

    with local_cluster(Path(tmp)) as cluster:
        client = redis_client(cluster.url, 5.0)   # redis+cluster://127.0.0.1:p1,...
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from omniflow.localredis import CLUSTER_SCHEME


@dataclass(frozen=True, slots=True)
class LocalCluster:
    ports: tuple[int, ...]
    pids: tuple[int, ...]

    @property
    def url(self) -> str:
        return f"{CLUSTER_SCHEME}://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def used_memory(self) -> int:
        """Bytes in use, summed over the masters (INFO memory)."""
        return sum(int(self.node(p).info("memory")["used_memory"]) for p in self.ports)


def missing_reason(binary: str | None = None) -> str | None:
    """None when a cluster can be made here, else what is missing."""
    if not (binary or shutil.which("redis-server")):
        return "needs redis-server"
    if not shutil.which("redis-cli"):
        return "needs redis-cli (the redis-tools package) to create the cluster"
    return None


def _free_port() -> int:
    # A cluster node also listens on its port + 10000 (the cluster bus), so the port must
    # stay below 55536; the kernel's ephemeral range reaches 60999.
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < 55536:
            return port
    raise RuntimeError("redis cluster: no free port below 55536 for a node and its bus")


def _wait(check: object, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except redis.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis cluster: {what} not reached in {timeout_s}s")
        time.sleep(0.05)


def _state(port: int) -> str:
    info = redis.Redis(port=port, socket_timeout=2, decode_responses=True).cluster("info")
    return str(info.get("cluster_state", ""))


@contextlib.contextmanager
def local_cluster(folder: Path, n: int = 3, binary: str | None = None) -> Iterator[LocalCluster]:
    """``n`` cluster-enabled masters under ``folder`` (one subfolder each)."""
    exe = binary or shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if exe is None or cli is None:
        raise RuntimeError(missing_reason(binary) or "")
    ports = tuple(_free_port() for _ in range(n))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            d = folder / str(port)
            d.mkdir(parents=True, exist_ok=True)
            cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                   "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                   "--save", "", "--appendonly", "no", "--dir", str(d)]  # fmt: skip
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        for port in ports:
            _wait(lambda p=port: redis.Redis(port=p, socket_timeout=1).ping(), "PING", 10)
        create = [cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                  "--cluster-replicas", "0", "--cluster-yes"]  # fmt: skip
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        _wait(lambda: all(_state(p) == "ok" for p in ports), "cluster_state:ok", 30)
        yield LocalCluster(ports, tuple(p.pid for p in procs))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
