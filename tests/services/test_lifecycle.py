"""Every service: SERVING only once registered, visible in discovery, gone within the TTL
after SIGKILL, deregistered at once after SIGTERM. Real processes, real Redis."""

from __future__ import annotations

import asyncio
import signal

import pytest
from inprocess import eventually

from omniflow.discovery import make_registry
from omniflow.rpc.client import check_health

# (module, discovery name, extra env)
SERVICES = [
    ("router", "router", {}),
    ("coordinator", "coordinator", {}),
    ("kv_index", "kv-index", {}),
    ("kv_agent", "kv-agent", {}),
    ("worker", "worker", {"OMNIFLOW_WORKER_ROLE": "llm"}),
]
TTL_S = 1.5


async def _listed(redis_url: str, service: str) -> list[str]:
    registry = make_registry("redis", url=redis_url)
    try:
        return [i.instance_id for i in await registry.list(service)]
    finally:
        await registry.close()


@pytest.mark.integration
@pytest.mark.parametrize(("module", "service", "env"), SERVICES, ids=[s[0] for s in SERVICES])
async def test_register_serve_and_deregister_on_sigterm(spawn, private_redis, module, service, env):
    proc = spawn(module, f"{module}-a", OMNIFLOW_REGISTRATION_TTL_S=str(TTL_S), **env)
    ready = (await asyncio.to_thread(proc.wait_ready)).info
    # The ready file is written after registration: by now both must hold.
    assert await check_health(ready["address"]) == "SERVING"
    assert f"{module}-a" in await _listed(private_redis.url, service)
    assert ready["service"] == service

    proc.popen.send_signal(signal.SIGTERM)
    rc = await asyncio.to_thread(proc.popen.wait, 15)
    assert rc == 0, proc.tail()
    # Deregistered at shutdown, not by TTL: gone right away.
    assert f"{module}-a" not in await _listed(private_redis.url, service)
    assert await check_health(ready["address"], timeout_s=0.5) == "UNREACHABLE"


@pytest.mark.integration
@pytest.mark.parametrize(("module", "service", "env"), SERVICES, ids=[s[0] for s in SERVICES])
async def test_disappears_within_ttl_after_sigkill(spawn, private_redis, module, service, env):
    proc = spawn(module, f"{module}-k", OMNIFLOW_REGISTRATION_TTL_S=str(TTL_S), **env)
    await asyncio.to_thread(proc.wait_ready)
    assert f"{module}-k" in await _listed(private_redis.url, service)
    proc.popen.send_signal(signal.SIGKILL)
    await asyncio.to_thread(proc.popen.wait, 10)

    async def gone() -> bool:
        return f"{module}-k" not in await _listed(private_redis.url, service)

    # Nobody deregistered it: only the TTL (plus a little slack for the poll) removes it.
    await eventually(gone, TTL_S + 2.0, f"{module}-k leaves discovery after SIGKILL")


@pytest.mark.integration
async def test_not_serving_until_dependencies_answer(spawn, tmp_path):
    # A Redis URL where nothing listens: kv-index must never turn SERVING, and must exit.
    proc = spawn(
        "kv_index",
        "kv-index-nodeps",
        OMNIFLOW_REDIS_URL="redis://127.0.0.1:1/0",
        OMNIFLOW_CALL_TIMEOUT_S="1",
    )
    rc = await asyncio.to_thread(proc.popen.wait, 30)
    assert rc == 1
    assert not proc.ready_file.exists()
    assert "failed to start" in proc.tail()


@pytest.mark.integration
async def test_bad_setting_fails_fast_naming_the_variable(spawn):
    proc = spawn("router", "router-bad", OMNIFLOW_REGISTRATION_TTL_S="soon")
    rc = await asyncio.to_thread(proc.popen.wait, 30)
    assert rc == 2
    assert "OMNIFLOW_REGISTRATION_TTL_S='soon' is not a number" in proc.tail()
    proc2 = spawn("worker", "worker-bad", OMNIFLOW_WORKER_ROLE="painter")
    assert await asyncio.to_thread(proc2.popen.wait, 30) == 2
    assert "OMNIFLOW_WORKER_ROLE='painter' is not accepted; accepted: llm, encoder" in proc2.tail()
