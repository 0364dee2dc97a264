"""What one client can make the gateway hold, against a real gateway process: headers past
the bound get 431; slowloris (60 connections sending a byte a second), a connection that
sends nothing and a body that never comes are closed with 408 within their deadlines; a
tenant past its share of requests in flight gets 429 naming the limit while another
tenant is served; a prompt past its bound is refused before it is templated or tokenized,
as text, chat messages or token ids."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from omniflow.testing.launch import ServiceProc

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "key-a-" + os.urandom(8).hex(), "key-b-" + os.urandom(8).hex()


@pytest.fixture
def gateway(launch: Callable[..., ServiceProc], tmp_path: Path) -> tuple[str, int]:
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"keys": [{"key": KEY_A, "tenant": "a"}, {"key": KEY_B, "tenant": "b"}]})
    )
    keys.chmod(0o600)
    proc = launch(
        "omniflow_services.gateway",
        "gateway",
        OMNIFLOW_GATEWAY_PORT="0",
        OMNIFLOW_GATEWAY_API_KEYS_FILE=str(keys),
        OMNIFLOW_GATEWAY_HEADER_TIMEOUT_S="2",
        OMNIFLOW_GATEWAY_BODY_TIMEOUT_S="3",
        OMNIFLOW_GATEWAY_MAX_HEADER_BYTES="8192",
        OMNIFLOW_GATEWAY_TENANT_MAX_IN_FLIGHT="2",
        OMNIFLOW_GATEWAY_MAX_PROMPT_BYTES="4096",
        OMNIFLOW_GATEWAY_FAILOVER_WAIT_S="0",
    ).wait_ready(timeout_s=60)
    url = proc.info["url"]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _exchange(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), timeout=15)
    writer.close()
    return reply


async def test_headers_past_the_bound_get_431(gateway: tuple[str, int]) -> None:
    host, port = gateway
    small = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 2000 + b"\r\n\r\n"
    assert (await _exchange(host, port, small)).startswith(b"HTTP/1.1 200")
    big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 64 * 1024 + b"\r\n\r\n"
    reply = await _exchange(host, port, big)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b"OMNIFLOW_GATEWAY_MAX_HEADER_BYTES" in reply


async def _slow_client(host: str, port: int, request: bytes) -> tuple[float, bytes]:
    """Send ``request`` one byte a second; (seconds until the gateway closed it, reply)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    reply = b""
    try:
        for byte in request:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                reply += await asyncio.wait_for(reader.read(4096), timeout=1.0)
            except TimeoutError:
                continue
            if reply or reader.at_eof():
                break
        reply += await asyncio.wait_for(reader.read(), timeout=10)
    except (ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()
    return time.monotonic() - started, reply


async def test_slowloris_and_silent_connections_are_closed(gateway: tuple[str, int]) -> None:
    host, port = gateway
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"z" * 100 + b"\r\n\r\n"
    clients = [asyncio.create_task(_slow_client(host, port, request)) for _ in range(60)]
    # A silent connection (opens, sends nothing) and a legitimate request meanwhile.
    reader, writer = await asyncio.open_connection(host, port)
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"http://{host}:{port}/health")).status_code == 200
    silent = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    assert silent.startswith(b"HTTP/1.1 408"), silent[:200]
    results = await asyncio.gather(*clients)
    slow = [t for t, _ in results if t > 8]
    assert not slow, f"{len(slow)} of 60 slow connections held over 8 s"
    assert all(r.startswith(b"HTTP/1.1 408") for _, r in results), results[0][1][:200]


async def _stalled_body(host: str, port: int, key: str) -> bytes:
    """A POST whose body never comes: in flight until the body deadline."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
        "content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
    ).encode()
    return await _exchange(host, port, head)


async def test_a_tenant_past_its_share_is_refused_alone(gateway: tuple[str, int]) -> None:
    host, port = gateway
    base = f"http://{host}:{port}"
    stalled = [asyncio.create_task(_stalled_body(host, port, KEY_A)) for _ in range(2)]
    await asyncio.sleep(0.5)  # both are in flight (waiting for their bodies)
    async with httpx.AsyncClient(timeout=10) as http:
        a = await http.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY_A}"})
        assert a.status_code == 429, a.text
        assert "OMNIFLOW_GATEWAY_TENANT_MAX_IN_FLIGHT" in a.json()["error"]["message"]
        b = await http.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY_B}"})
        assert b.status_code == 200, b.text
        # The stalled bodies end with 408 at their deadline, and A has its share back.
        for reply in await asyncio.gather(*stalled):
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert b"OMNIFLOW_GATEWAY_BODY_TIMEOUT_S" in reply
        a = await http.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY_A}"})
        assert a.status_code == 200, a.text


async def test_a_prompt_past_its_bound_is_refused_before_tokenizing(
    gateway: tuple[str, int],
) -> None:
    host, port = gateway
    auth = {"authorization": f"Bearer {KEY_A}"}
    big = "word " * 1000  # 5000 bytes > 4096
    bodies = [
        ("/v1/completions", {"model": "m", "prompt": big}),
        ("/v1/completions", {"model": "m", "prompt": list(range(1100))}),  # 4400 bytes of ids
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": big}]}),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": big}]}],
            },
        ),
    ]
    async with httpx.AsyncClient(timeout=10) as http:
        for path, body in bodies:
            reply = await http.post(f"http://{host}:{port}{path}", json=body, headers=auth)
            assert reply.status_code == 400, (path, reply.text)
            assert "OMNIFLOW_GATEWAY_MAX_PROMPT_BYTES" in reply.json()["error"]["message"]
        # Under the bound the same request goes on (to "no such model": 404, not a 400).
        small = {"model": "m", "prompt": "hello"}
        reply = await http.post(f"http://{host}:{port}/v1/completions", json=small, headers=auth)
        assert reply.status_code == 404, reply.text
