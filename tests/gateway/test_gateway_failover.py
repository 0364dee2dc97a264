"""The gateway keeps every router it discovers and fails over between them; it waits for a
lone router that restarts; a worker that dies mid-answer costs a non-streamed request
nothing (it is generated again elsewhere). Real processes on a Redis of the test's own:
echo TEST workers (their answer echoes the prompt's token ids, so it is checkable), two
routers, the gateway; requests through the official ``openai`` client with its own
retries off, so that every failure the gateway lets through is seen."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.rpc.client import open_channel
from omniflow.testing.launch import ServiceProc

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai", reason="the official openai client is the reference")

ECHO = "omniflow_services.worker"  # with the echo engine (OMNIFLOW_WORKER_ENGINE=echo)
ROUTER = "omniflow_services.router"
GATEWAY = "omniflow_services.gateway"
PROMPT = "the quick brown fox jumps over the lazy dog " * 2


def _models_dir(tmp: Path) -> Path:
    """A folder the gateway finds the echo model's tokenizer in (a generated tiny model's)."""
    from omniflow.models.tiny import make_tiny

    models = tmp / "models"
    make_tiny("qwen2", models / "echo")
    return models


def _topology(
    launch: Callable[..., ServiceProc],
    tmp: Path,
    *,
    routers: int,
    delay_ms: str,
    workers: int = 2,
    **gateway_env: str,
) -> dict[str, ServiceProc]:
    procs: dict[str, ServiceProc] = {}
    for i in range(workers):
        procs[f"llm-{i}"] = launch(
            ECHO,
            f"llm-{i}",
            OMNIFLOW_WORKER_ENGINE="echo",
            OMNIFLOW_WORKER_ROLE="llm",
            OMNIFLOW_ECHO_TOKEN_DELAY_MS=delay_ms,
        )
    for proc in procs.values():
        proc.wait_ready()
    for i in range(routers):
        procs[f"router-{i}"] = _router(launch, f"router-{i}")
    env = {
        "OMNIFLOW_GATEWAY_PORT": "0",
        "OMNIFLOW_MODELS_DIR": str(_models_dir(tmp)),
        "OMNIFLOW_GATEWAY_LLM_STRATEGY": "round_robin",
        "OMNIFLOW_GATEWAY_CATALOG_TTL_S": "0.2",
        **gateway_env,
    }
    procs["gateway"] = launch(GATEWAY, "gateway", **env).wait_ready(timeout_s=60)
    return procs


def _router(launch: Callable[..., ServiceProc], name: str) -> ServiceProc:
    return launch(
        ROUTER, name, OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2", OMNIFLOW_REGISTRATION_TTL_S="3"
    ).wait_ready()


def _client(gateway: ServiceProc) -> openai.AsyncOpenAI:
    # max_retries=0: a failure the gateway lets through must show here, not be retried away.
    return openai.AsyncOpenAI(
        base_url=gateway.info["url"] + "/v1", api_key="none", max_retries=0, timeout=60
    )


async def _complete(client: openai.AsyncOpenAI, stream: bool) -> str:
    if not stream:
        reply = await client.completions.create(model="echo", prompt=PROMPT, max_tokens=64)
        return reply.choices[0].text
    parts = []
    async for chunk in await client.completions.create(
        model="echo", prompt=PROMPT, max_tokens=64, stream=True
    ):
        parts.extend(c.text for c in chunk.choices)
    return "".join(parts)


async def _outcome(client: openai.AsyncOpenAI, stream: bool, delay_s: float) -> str:
    await asyncio.sleep(delay_s)
    try:
        return await _complete(client, stream)
    except openai.APIError as exc:
        return f"FAILED {type(exc).__name__}: {exc}"


async def _picks(router: str) -> int:
    async with open_channel(router) as channel:
        stats = await router_pb2_grpc.RouterServiceStub(channel).GetStats(
            router_pb2.GetStatsRequest(), timeout=5
        )
    return sum(n for name, n in stats.counters.items() if name.startswith("pick_"))


def _metric(gateway: ServiceProc, name: str) -> float:
    text = httpx.get(gateway.info["url"] + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_killing_one_of_two_routers_loses_no_request(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    procs = _topology(launch, tmp_path, routers=2, delay_ms="20")
    client = _client(procs["gateway"])
    expected = await _complete(client, stream=False)
    assert expected.startswith("echo: ") and len(expected.split()) > 5, expected
    # 40 requests spread over ~2 s, streamed and not; a router dies 0.5 s in.
    tasks = [
        asyncio.create_task(_outcome(client, stream=i % 2 == 1, delay_s=i * 0.05))
        for i in range(40)
    ]
    await asyncio.sleep(0.5)
    # The router the gateway uses is the one that made the picks so far: that one dies.
    picks = {name: await _picks(procs[name].address) for name in ("router-0", "router-1")}
    procs[max(picks, key=lambda n: picks[n])].kill()
    answers = await asyncio.gather(*tasks)
    wrong = [a for a in answers if a != expected]
    assert not wrong, f"{len(wrong)} of 40 failed or wrong, e.g. {wrong[0]!r}"
    # The gateway did meet the dead router (else this test proved nothing).
    assert _metric(procs["gateway"], 'omniflow_gateway_failovers_total{service="router"}') > 0
    await client.close()


async def test_a_lone_router_restarting_is_waited_for(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    procs = _topology(launch, tmp_path, routers=1, delay_ms="5")
    client = _client(procs["gateway"])
    expected = await _complete(client, stream=False)
    procs["router-0"].kill()
    killed = time.monotonic()
    tasks = [
        asyncio.create_task(_outcome(client, stream=i % 2 == 1, delay_s=i * 0.1)) for i in range(10)
    ]
    await asyncio.sleep(1.5)  # the supervisor's restart, by hand: a new router, a new port
    _router(launch, "router-1")
    answers = await asyncio.gather(*tasks)
    assert answers == [expected] * 10, answers
    assert time.monotonic() - killed > 1.5  # some of them did wait for the new router
    await client.close()


async def test_a_worker_dying_mid_answer_is_retried_for_a_whole_answer(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    # 100 ms per word: an answer of ~20 words takes 2 s, so the kill lands mid-answer.
    procs = _topology(launch, tmp_path, routers=1, delay_ms="100")
    client = _client(procs["gateway"])
    expected = await _complete(client, stream=False)
    tasks = [asyncio.create_task(_outcome(client, False, i * 0.05)) for i in range(6)]
    await asyncio.sleep(0.8)
    procs["llm-0"].kill()
    answers = await asyncio.gather(*tasks)
    assert answers == [expected] * 6, answers
    retried = 'omniflow_gateway_worker_retries_total{when="mid_answer"}'
    assert _metric(procs["gateway"], retried) > 0  # round robin sent some to llm-0
    await client.close()


async def test_a_tenant_past_its_tokens_per_minute_is_refused_alone(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    keys = tmp_path / "keys.json"
    key_a, key_b = "tpm-a-" + "1" * 16, "tpm-b-" + "2" * 16
    keys.write_text(
        json.dumps({"keys": [{"key": key_a, "tenant": "a"}, {"key": key_b, "tenant": "b"}]})
    )
    keys.chmod(0o600)
    procs = _topology(
        launch,
        tmp_path,
        routers=1,
        delay_ms="1",
        OMNIFLOW_GATEWAY_API_KEYS_FILE=str(keys),
        OMNIFLOW_GATEWAY_TENANT_TOKENS_PER_MINUTE="60",
    )
    url = procs["gateway"].info["url"] + "/v1"
    a = openai.AsyncOpenAI(base_url=url, api_key=key_a, max_retries=0)
    b = openai.AsyncOpenAI(base_url=url, api_key=key_b, max_retries=0)
    used = 0
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(20):  # each answer counts its prompt and generated tokens
            reply = await a.completions.create(model="echo", prompt=PROMPT, max_tokens=64)
            used += reply.usage.total_tokens
    assert used >= 60  # refused only once past its minute's share
    assert "OMNIFLOW_GATEWAY_TENANT_TOKENS_PER_MINUTE" in str(refused.value)
    reply = await b.completions.create(model="echo", prompt=PROMPT, max_tokens=64)
    assert reply.choices[0].text.startswith("echo: ")  # tenant b is served meanwhile
    await a.close()
    await b.close()


async def test_a_lone_worker_is_called_without_a_pick(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    # One worker serves "echo": the gateway calls it without asking the router (no Pick,
    # no outcome); with OMNIFLOW_GATEWAY_LONE_WORKER_PICK=true it asks, once per request.
    procs = _topology(launch, tmp_path, routers=1, delay_ms="0", workers=1)
    router = procs["router-0"].address
    client = _client(procs["gateway"])
    expected = await _complete(client, stream=False)
    assert expected.startswith("echo: "), expected
    for stream in (True, False, True):
        assert await _complete(client, stream) == expected
    assert await _picks(router) == 0
    await client.close()
    asking = launch(
        GATEWAY,
        "gateway-asking",
        OMNIFLOW_GATEWAY_PORT="0",
        OMNIFLOW_MODELS_DIR=str(tmp_path / "models"),
        OMNIFLOW_GATEWAY_LONE_WORKER_PICK="true",
    ).wait_ready(timeout_s=60)
    client = _client(asking)
    for stream in (True, False):
        assert await _complete(client, stream) == expected
    assert await _picks(router) == 2
    await client.close()


async def test_a_lone_worker_that_died_is_asked_of_the_router_then_503(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    # The model's only worker died without deregistering: the direct call fails, the retry
    # asks the router (which has nothing better), and the answer is 503 within the wait (a
    # streamed one would have had its 200 already, and ends with an error event).
    procs = _topology(
        launch, tmp_path, routers=1, delay_ms="0", workers=1, OMNIFLOW_GATEWAY_FAILOVER_WAIT_S="1"
    )
    client = _client(procs["gateway"])
    await _complete(client, stream=False)
    procs["llm-0"].kill()
    with pytest.raises(openai.APIStatusError) as err:
        await _complete(client, stream=False)
    assert err.value.status_code == 503, err.value
    assert await _picks(procs["router-0"].address) > 0  # the retry did ask the router
    await client.close()
