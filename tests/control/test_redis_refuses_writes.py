"""A Redis that refuses writes (READONLY, MISCONF) is UNAVAILABLE to the kv-index's and the
coordinator's callers — retryable, never INTERNAL — and both recover when Redis does. Real
redis-server, real kv-index, router, coordinator and echo TEST worker processes:

- READONLY: the test's Redis made a replica of a port nobody listens on
  (``REPLICAOF 127.0.0.1 <closed port>``), then a primary again (``REPLICAOF NO ONE``);
- MISCONF: ``stop-writes-on-bgsave-error yes`` with its ``dir`` on a 1 MiB tmpfs the test
  mounts and fills, a ``BGSAVE`` that fails; space freed and a ``BGSAVE`` that succeeds
  lets writes in again. Needs ``mount`` (root): skips saying why otherwise.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.coordinator.v1 import coordinator_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.dsl import VType, Workflow
from omniflow.errors import OmniflowError
from omniflow.localredis import RedisProcess, start_redis
from omniflow.rpc.client import open_channel
from omniflow.testing.launch import ServiceProc

pytestmark = pytest.mark.integration


def _workflow(name: str) -> Workflow:
    wf = Workflow(name)
    wf.output("t", wf.call("say", "llm", "generate", prompt=wf.input("p", VType.TEXT))["text"])
    return wf


def _layout(model: str) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        model_id=model, num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", page_size=16
    )


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Calls:
    """One write to the kv-index and two to the coordinator, each answering its code."""

    def __init__(self, index: str, coordinator: str) -> None:
        self.index = open_channel(index, default_timeout_s=10)
        self.coord = open_channel(coordinator, default_timeout_s=10)
        self.kv = kvindex_pb2_grpc.KVIndexServiceStub(self.index)
        self.co = coordinator_pb2_grpc.CoordinatorServiceStub(self.coord)

    async def codes(self) -> list[str]:
        tag = uuid.uuid4().hex[:8]
        calls = (
            self.kv.RegisterNamespace(kvindex_pb2.RegisterNamespaceRequest(layout=_layout(tag))),
            self.co.RegisterWorkflow(
                cpb.RegisterWorkflowRequest(graph=_workflow(f"wf-{tag}").compile())
            ),
            self.co.SubmitRun(
                cpb.SubmitRunRequest(
                    workflow="known", run_id=f"r-{tag}", inputs={"p": common_pb2.Value(text=tag)}
                )
            ),
        )
        out = []
        for call in calls:
            try:
                await call
                out.append("OK")
            except OmniflowError as exc:
                out.append(exc.code_name)
        return out

    async def until_ok(self, timeout_s: float = 30.0) -> list[str]:
        end = time.monotonic() + timeout_s
        while True:
            codes = await self.codes()
            if codes == ["OK"] * 3 or time.monotonic() > end:
                return codes
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self.index.close()
        await self.coord.close()


async def _topology(
    cluster: Callable[..., dict[str, ServiceProc]], launch: Callable[..., ServiceProc]
) -> tuple[Calls, dict[str, ServiceProc]]:
    procs = cluster({"llm": 1})
    index = launch("omniflow_services.kv_index", "kv-index").wait_ready()
    calls = Calls(index.address, procs["coordinator"].address)
    await calls.co.RegisterWorkflow(cpb.RegisterWorkflowRequest(graph=_workflow("known").compile()))
    assert await calls.codes() == ["OK"] * 3  # the control: every write goes through
    return calls, procs


async def _a_run_succeeds(calls: Calls) -> None:
    run_id = f"after-{uuid.uuid4().hex[:8]}"
    req = cpb.SubmitRunRequest(
        workflow="known", run_id=run_id, inputs={"p": common_pb2.Value(text="back")}
    )
    await calls.co.SubmitRun(req)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        run = (await calls.co.GetRun(cpb.GetRunRequest(run_id=run_id))).run
        if run.state not in (cpb.RUN_STATE_RUNNING, cpb.RUN_STATE_PENDING):
            assert run.state == cpb.RUN_STATE_SUCCEEDED, run.error
            assert run.outputs["t"].text == "echo: back"
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the run after the recovery did not end")


async def test_readonly_redis_is_unavailable_and_recovers(
    cluster: Callable[..., dict[str, ServiceProc]],
    launch: Callable[..., ServiceProc],
    private_redis: RedisProcess,
) -> None:
    calls, _ = await _topology(cluster, launch)
    admin = redis.Redis.from_url(private_redis.url)
    try:
        admin.execute_command("REPLICAOF", "127.0.0.1", _closed_port())
        with pytest.raises(redis.exceptions.ReadOnlyError):
            admin.set("probe", "1")  # what the services' clients now meet
        assert await calls.codes() == ["UNAVAILABLE"] * 3
        admin.execute_command("REPLICAOF", "NO", "ONE")
        assert await calls.until_ok() == ["OK"] * 3
        await _a_run_succeeds(calls)
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")
        admin.close()
        await calls.close()


@pytest.fixture
def private_redis(request: pytest.FixtureRequest, tmp_path: Path, redis_binary: Path):
    """The test's Redis (the ``launch`` fixture's); with param ``"tiny"`` its ``dir`` (where
    it saves) is a 1 MiB tmpfs mounted here and unmounted after — ``dir`` cannot be changed
    at run time (a protected config) — and the test skips when mounting is not allowed."""
    folder = tmp_path / "redis"
    folder.mkdir()
    tiny = getattr(request, "param", "") == "tiny"
    if tiny:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(folder)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"needs to mount a tmpfs (root): {done.stderr.strip() or done.returncode}")
    try:
        server = start_redis(dir=folder, binary=redis_binary)
        try:
            yield server
        finally:
            server.stop()
    finally:
        if tiny:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until its file system has no byte left."""
    try:
        with open(path, "wb") as out:
            while True:
                out.write(b"\0" * 4096)
                out.flush()
    except OSError:  # no space left (the file itself may not have been made)
        pass


def _bgsave_status(admin: redis.Redis) -> tuple[bool, str]:
    info = admin.info("persistence")
    return bool(info["rdb_bgsave_in_progress"]), str(info["rdb_last_bgsave_status"])


def _bgsave(admin: redis.Redis) -> str:
    while _bgsave_status(admin)[0]:
        time.sleep(0.05)
    admin.bgsave()
    time.sleep(0.1)
    while _bgsave_status(admin)[0]:
        time.sleep(0.05)
    return _bgsave_status(admin)[1]


@pytest.mark.parametrize("private_redis", ["tiny"], indirect=True)
async def test_misconf_redis_is_unavailable_and_recovers(
    cluster: Callable[..., dict[str, ServiceProc]],
    launch: Callable[..., ServiceProc],
    private_redis: RedisProcess,
) -> None:
    calls, _ = await _topology(cluster, launch)
    admin = redis.Redis.from_url(private_redis.url)
    filler = private_redis.dir / "filler"
    try:
        # Writes stop after a failed save only where saving is configured at all.
        admin.config_set("save", "3600 1")
        admin.config_set("stop-writes-on-bgsave-error", "yes")
        _fill(filler)
        assert _bgsave(admin) == "err"
        with pytest.raises(redis.exceptions.ResponseError, match="MISCONF"):
            admin.set("probe", "1")
        assert await calls.codes() == ["UNAVAILABLE"] * 3
        filler.unlink(missing_ok=True)  # space again: the next save succeeds and writes are taken
        assert _bgsave(admin) == "ok"
        assert await calls.until_ok() == ["OK"] * 3
        await _a_run_succeeds(calls)
    finally:
        filler.unlink(missing_ok=True)
        admin.close()
        await calls.close()
