"""Fuzz the gateway's HTTP API (``http_fuzzer``) on the shared fuzz topology: no 500, the
process is alive, the same greedy completion before and after (through the official
``openai`` client), RSS within a wide margin."""

from __future__ import annotations

import os

import pytest
from conftest import MAX_BODY, FuzzTopology
from fuzzer import Tally, fuzz_requests, report
from http_fuzzer import fuzz_http

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai", reason="the official openai client is the reference")

SEED = int(os.environ.get("OMNIFLOW_FUZZ_SEED", "1"))
CANARY = "the fuzz canary says"


async def _complete(base_url: str) -> tuple[str, str]:
    """(model id, greedy completion of the canary)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as api:
        models = await api.models.list()
        model = next(  # the llm's: the embed and encoder workers serve models too
            m.id
            for m in models.data
            if not any(k in m.id.lower() for k in ("minilm", "whisper", "workflow:"))
        )
        done = await api.completions.create(
            model=model, prompt=CANARY, max_tokens=8, temperature=0, timeout=60
        )
        return model, done.choices[0].text


async def test_fuzz_gateway(fuzz_topology: FuzzTopology) -> None:
    topo = fuzz_topology
    url = topo.procs["gateway"].info["url"]
    model, before = await _complete(url + "/v1")
    tally = Tally("gateway")
    tally.rss_before_kb = topo.rss_kb("gateway")
    tracebacks = topo.log_tracebacks("gateway")
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as api:
        served = [m.id for m in (await api.models.list()).data]  # llm, embed, encoder models
    await fuzz_http(
        url, tally, fuzz_requests(), model=model, models=served, max_body=MAX_BODY, seed=SEED
    )
    tally.crashed = not topo.alive("gateway")
    if not tally.crashed:
        tally.rss_after_kb = topo.rss_kb("gateway")
    tally.tracebacks = topo.log_tracebacks("gateway") - tracebacks
    report(tally)
    assert not tally.crashed, topo.procs["gateway"].tail()
    assert tally.bad_count == 0, "gateway: 500s for client mistakes:\n" + "\n".join(tally.bad)
    assert tally.rss_after_kb < 2 * tally.rss_before_kb + 256 * 1024
    assert (await _complete(url + "/v1")) == (model, before)
