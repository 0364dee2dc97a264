"""The gateway's direct chat path with one llm worker: chats sent while that worker is
SIGKILLed and restarted by the supervisor answer, none fails. ``omniflow up`` (supervised,
TLS and auth on) with one echo TEST worker, the official ``openai`` client with its own
retries off: a non-streamed chat in flight at the kill, then chats streamed and not sent
while the worker is down and while it starts again; each answer equals the one recorded
before the kill."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omniflow.security.local import client_record
from omniflow.testing.chaos import LocalTopology

openai = pytest.importorskip("openai", reason="needs the official openai client")
pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "one two three four five six"}]


async def _chat(client, stream: bool) -> str:
    if not stream:
        reply = await client.chat.completions.create(
            model="echo", messages=MESSAGES, max_tokens=32, temperature=0
        )
        return reply.choices[0].message.content
    parts = []
    async for chunk in await client.chat.completions.create(
        model="echo", messages=MESSAGES, max_tokens=32, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


@pytest.mark.timeout(240)
async def test_chats_sent_while_the_lone_worker_restarts_answer(
    tmp_path: Path, redis_binary: Path
) -> None:
    topo = LocalTopology(tmp_path, workers=1, token_delay_ms=100)
    topo.up()
    try:
        key = client_record(topo.run_dir).get("gateway_api_key", "")
        url = topo.addresses("gateway")[0]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        expected = await _chat(client, stream=False)
        assert expected and await _chat(client, stream=True) == expected
        old = topo.procs()["llm-1"]["pid"]
        in_flight = asyncio.create_task(_chat(client, stream=False))
        await asyncio.sleep(0.3)  # its generation is under way: 100 ms a token
        topo.kill("llm-1")
        sent = [in_flight]
        for _ in range(3):  # down, restarting (supervisor backoff, start), back
            sent += [asyncio.create_task(_chat(client, s)) for s in (False, True)]
            await asyncio.sleep(0.7)
        answers = await asyncio.gather(*sent, return_exceptions=True)
        assert topo.procs()["llm-1"]["pid"] != old  # the supervisor restarted it
        assert answers == [expected] * len(sent), answers
        await client.close()
    finally:
        topo.down()
