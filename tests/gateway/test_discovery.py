"""The gateway in discovery: registered with its URL, deregistered on SIGTERM; a model whose
only worker is gone is a 503 (no worker), not a hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest

from omniflow.discovery import ServiceInstance, make_registry
from omniflow.workers import WORKER_SERVICE, worker_metadata

pytestmark = pytest.mark.integration


def _gateways(redis_url: str) -> list[ServiceInstance]:
    async def go() -> list[ServiceInstance]:
        async with make_registry("redis", url=redis_url) as registry:
            return await registry.list("gateway")

    return asyncio.run(go())


def test_registered_with_its_url_and_deregistered_on_sigterm(topology: Any) -> None:
    mine = [g for g in _gateways(topology.redis_url) if g.instance_id == "gateway"]
    assert len(mine) == 1 and mine[0].metadata["url"] == topology.gateway_url
    assert mine[0].metadata["protocol"] == "http"
    # A second gateway: SIGTERM takes it out of discovery at once, and it exits 0.
    ready = topology.tmp / "gateway-2.ready.json"
    env = {
        **os.environ,
        "OMNIFLOW_REDIS_URL": topology.redis_url,
        "OMNIFLOW_GATEWAY_PORT": "0",
        "OMNIFLOW_INSTANCE_ID": "gateway-2",
        "OMNIFLOW_READY_FILE": str(ready),
        "OMNIFLOW_ROUTER_ADDR": topology.procs["router"].address,
    }
    with open(topology.tmp / "gateway-2.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omniflow_services.gateway"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        end = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < end, "gateway-2 did not start"
            time.sleep(0.05)
        url = json.loads(ready.read_text())["url"]
        assert httpx.get(f"{url}/health").status_code == 200
        assert "gateway-2" in {g.instance_id for g in _gateways(topology.redis_url)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "gateway-2" not in {g.instance_id for g in _gateways(topology.redis_url)}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_model_with_no_live_worker_is_503(topology: Any) -> None:
    # A worker that registered and died without deregistering (its TTL not yet run out):
    # it serves "ghost", at an address where nothing listens.
    ghost = ServiceInstance(
        WORKER_SERVICE,
        "ghost-1",
        "127.0.0.1:9",
        {
            **worker_metadata("llm", "gw-node", str(topology.model_dir), "00" * 16, ("generate",)),
            "served_model": "ghost",
        },
    )

    def calls() -> None:
        client = openai.OpenAI(base_url=topology.base_url, api_key=topology.api_key, max_retries=0)
        time.sleep(1.5)  # the gateway's listing (OMNIFLOW_GATEWAY_CATALOG_TTL_S) sees it
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(
                model="ghost", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert err.value.status_code == 503
        assert err.value.response.json()["error"]["type"] == "service_unavailable"
        # The live model is unaffected.
        ok = client.chat.completions.create(
            model=topology.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert ok.choices[0].message.content is not None

    async def run() -> None:
        async with make_registry("redis", url=topology.redis_url) as registry:
            await registry.register(ghost, 30.0)
            try:
                await asyncio.to_thread(calls)
            finally:
                await registry.deregister(ghost.instance_id)

    asyncio.run(run())
