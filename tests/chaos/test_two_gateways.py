"""Two gateways on one topology (``gateways: 2`` in the topology file): both serve chats
and workflow-model runs with the same answers (the runs, workflows and KV they use are the
coordinator's and the index's, not theirs); one SIGKILLed, a client that retries on the
other address loses nothing, and the supervisor brings the killed one back on its port.
``omniflow up`` (supervised, TLS and auth on), two echo TEST workers, the official
``openai`` client with its own retries off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omniflow.client import Client
from omniflow.security.local import client_record, use_local_security
from omniflow.security.transport import configure as configure_security
from omniflow.testing.chaos import LocalTopology, chaos_workflow

openai = pytest.importorskip("openai", reason="needs the official openai client")
pytestmark = pytest.mark.integration

PROMPTS = [f"q{i} how are the pages today" for i in range(3)]


async def _chat(client, model: str, prompt: str) -> str:
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0
    )
    return reply.choices[0].message.content


async def _either(clients: list, model: str, prompt: str) -> str:
    """What a client behind a load balancer sees: the first address, else the other."""
    try:
        return await _chat(clients[0], model, prompt)
    except (openai.APIConnectionError, openai.APITimeoutError):
        return await _chat(clients[1], model, prompt)


@pytest.mark.timeout(240)
async def test_two_gateways_serve_alike_and_one_survives_the_other(
    tmp_path: Path, redis_binary: Path
) -> None:
    topo = LocalTopology(tmp_path, workers=2, gateways=2, token_delay_ms=20)
    topo.up()
    secured = use_local_security(topo.run_dir)
    clients: list = []
    try:
        async with Client(",".join(topo.addresses("coordinator"))) as control:
            await control.register(chaos_workflow())
        urls = topo.addresses("gateway")
        assert len(urls) == 2 and urls[0] != urls[1], urls
        key = client_record(topo.run_dir)["gateway_api_key"]
        clients = [
            openai.AsyncOpenAI(base_url=f"{u}/v1", api_key=key, max_retries=0, timeout=30)
            for u in urls
        ]
        models = ("echo", "workflow:chaos")
        expected = {(m, p): await _chat(clients[0], m, p) for m in models for p in PROMPTS}
        assert all(expected.values())
        for (model, prompt), text in expected.items():  # the other gateway answers alike
            assert await _chat(clients[1], model, prompt) == text

        procs = topo.procs()
        assert procs["gateway-2"]["address"] == urls[1]
        old = procs["gateway"]["pid"]
        in_flight = [asyncio.create_task(_either(clients, m, p)) for m, p in expected]
        await asyncio.sleep(0.05)
        topo.kill("gateway")
        later = [asyncio.create_task(_either(clients, m, p)) for m, p in expected]
        answers = await asyncio.gather(*in_flight, *later)
        assert answers == [*expected.values()] * 2, answers

        async def back() -> str:  # the supervisor restarts it on the same port
            while True:
                try:
                    return await _chat(clients[0], "echo", PROMPTS[0])
                except (openai.APIConnectionError, openai.APITimeoutError):
                    await asyncio.sleep(0.5)

        assert await asyncio.wait_for(back(), 90) == expected[("echo", PROMPTS[0])]
        again = topo.procs()["gateway"]
        assert again["pid"] != old and again["address"] == urls[0]
    finally:
        for client in clients:
            await client.close()
        if secured:
            configure_security(None)
        topo.down()
