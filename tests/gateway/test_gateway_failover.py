"""The gateway picks workers in its own process: it serves with no router running, counts
its calls on each worker, and a worker that dies mid-answer costs a non-streamed request
nothing (it is generated again elsewhere). Real processes on a Redis of the test's own:
echo TEST workers (their answer echoes the prompt's token ids, so it is checkable) and
the gateway; requests through the official ``openai`` client with its own retries off, so
that every failure the gateway lets through is seen."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.rpc.client import open_channel
from omniflow.testing.launch import ServiceProc
from omniflow.values import to_python

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai", reason="the official openai client is the reference")

ECHO = "omniflow_services.worker"  # with the echo engine (OMNIFLOW_WORKER_ENGINE=echo)
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
    env = {
        "OMNIFLOW_GATEWAY_PORT": "0",
        "OMNIFLOW_MODELS_DIR": str(_models_dir(tmp)),
        "OMNIFLOW_GATEWAY_LLM_STRATEGY": "round_robin",
        "OMNIFLOW_GATEWAY_CATALOG_TTL_S": "0.2",
        **gateway_env,
    }
    procs["gateway"] = launch(GATEWAY, "gateway", **env).wait_ready(timeout_s=60)
    return procs


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


async def _calls(worker: ServiceProc) -> int:
    """The Generate calls an echo worker took (its ``stats`` operation)."""
    async with open_channel(worker.address) as channel:
        reply = await worker_pb2_grpc.WorkerServiceStub(channel).Invoke(
            worker_pb2.InvokeRequest(operation="stats"), timeout=5
        )
    return int(to_python(reply.outputs["calls"]))


def _metric(gateway: ServiceProc, name: str) -> float:
    text = httpx.get(gateway.info["url"] + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_requests_are_picked_in_the_gateway_with_no_router(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    # No router runs: every pick is the gateway's own (round robin over the two workers).
    procs = _topology(launch, tmp_path, delay_ms="20")
    client = _client(procs["gateway"])
    expected = await _complete(client, stream=False)
    assert expected.startswith("echo: ") and len(expected.split()) > 5, expected
    tasks = [
        asyncio.create_task(_outcome(client, stream=i % 2 == 1, delay_s=i * 0.02))
        for i in range(20)
    ]
    answers = await asyncio.gather(*tasks)
    wrong = [a for a in answers if a != expected]
    assert not wrong, f"{len(wrong)} of 20 failed or wrong, e.g. {wrong[0]!r}"
    # The gateway's round robin spread them over both workers.
    calls = [await _calls(procs[name]) for name in ("llm-0", "llm-1")]
    assert sum(calls) == 21 and min(calls) >= 9, calls
    await client.close()


async def test_a_worker_dying_mid_answer_is_retried_for_a_whole_answer(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    # 100 ms per word: an answer of ~20 words takes 2 s, so the kill lands mid-answer.
    procs = _topology(launch, tmp_path, delay_ms="100")
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


async def test_a_lone_worker_that_died_is_a_503_within_the_wait(
    launch: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    # The model's only worker died without deregistering: the call fails, the retries find
    # nothing better within the wait, and the answer is 503 (a streamed one would have had
    # its 200 already, and ends with an error event).
    procs = _topology(
        launch, tmp_path, delay_ms="0", workers=1, OMNIFLOW_GATEWAY_FAILOVER_WAIT_S="1"
    )
    client = _client(procs["gateway"])
    await _complete(client, stream=False)
    procs["llm-0"].kill()
    with pytest.raises(openai.APIStatusError) as err:
        await _complete(client, stream=False)
    assert err.value.status_code == 503, err.value
    retried = 'omniflow_gateway_worker_retries_total{when="before_first_token"}'
    assert _metric(procs["gateway"], retried) > 0  # the dead worker was tried again
    await client.close()
