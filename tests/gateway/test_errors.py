"""Bad requests get OpenAI-shaped errors with the right status (as the official client
raises them); a client that disconnects aborts its worker request; request ids."""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Hello!"}]
LONG = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


@pytest.fixture(scope="module")
def client(topology: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=topology.base_url, api_key=topology.api_key, max_retries=0)


@pytest.fixture(scope="module")
def http(topology: Any) -> httpx.Client:
    headers = {"Authorization": f"Bearer {topology.api_key}"}
    with httpx.Client(base_url=topology.gateway_url, headers=headers, timeout=60) as c:
        yield c


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)
    e = _error(err.value)
    assert e["param"] == "model" and "no-such-model" in e["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="workflow:no-such-flow", messages=HELLO)


def test_wrong_or_missing_api_key_is_401(topology: Any, http: httpx.Client) -> None:
    wrong = openai.OpenAI(base_url=topology.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert _error(err.value)["type"] == "authentication_error"
    reply = httpx.get(f"{topology.base_url}/models")  # no header at all
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    # Health and metrics need no key.
    assert httpx.get(f"{topology.gateway_url}/health").status_code == 200
    metrics = httpx.get(f"{topology.gateway_url}/metrics").text
    assert "omniflow_gateway_requests_total" in metrics


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        ({"temperature": 101}, "temperature"),  # the contract's range: [0, 100]
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"n": 99}, "n"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),  # at most 16
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": 9000}, "max_tokens"),  # beyond SmolLM2's context (8192)
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    client: openai.OpenAI, topology: Any, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=topology.model, messages=HELLO, max_tokens=2, extra_body=extra
        )
    e = _error(err.value)
    assert e["param"] == param, e
    assert e["type"] == "invalid_request_error"


def test_bad_bodies_are_400(http: httpx.Client, topology: Any) -> None:
    reply = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "x"})
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
    reply = http.post(
        "/v1/chat/completions",
        json={"model": topology.model, "messages": [{"role": "robot", "content": "x"}]},
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].role"
    reply = http.post(
        "/v1/chat/completions",
        json={
            "model": topology.model,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
        },
    )
    assert reply.status_code == 400 and "data URL" in reply.json()["error"]["message"]
    reply = http.post(
        "/v1/audio/speech", json={"model": "m", "input": "hi", "response_format": "mp3"}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "response_format"
    reply = http.post("/v1/images/generations", json={"model": "m", "prompt": "a", "size": "big"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "size"


def test_oversize_body_is_413(client: openai.OpenAI, topology: Any) -> None:
    big = [{"role": "user", "content": "x" * (300 * 1024)}]
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=topology.model, messages=big, max_tokens=1)
    assert err.value.status_code == 413
    assert _error(err.value)["code"] == "request_too_large"


def test_at_capacity_is_429(client: openai.OpenAI, topology: Any, http: httpx.Client) -> None:
    body = {"model": topology.model, "messages": LONG, "max_tokens": 400, "stream": True}
    body["temperature"] = 0
    # The gateway of the test topology serves 2 requests at once (OMNIFLOW_GATEWAY_MAX_IN_FLIGHT):
    # with two streams generating, a third request is refused. A stream can end early (an
    # eos, a preempted request): then the scenario did not hold and is tried again.
    for _attempt in range(3):
        with (
            http.stream("POST", "/v1/chat/completions", json=body) as a,
            http.stream("POST", "/v1/chat/completions", json=body) as b,
        ):
            streams = [a.iter_lines(), b.iter_lines()]
            for lines in streams:  # both are generating: a content chunk has come
                seen = [next(lines) for _ in range(4)]
                assert any('"content":"' in x and '"role"' not in x for x in seen), seen
            try:
                client.chat.completions.create(model=topology.model, messages=HELLO, max_tokens=1)
            except openai.RateLimitError as err:
                assert _error(err)["code"] == "at_capacity"
                break
            rest = [list(lines) for lines in streams]
            ended_early = [r for r in rest if sum('"content":"' in x for x in r) < 20]
            assert ended_early, "a third request was served while two streams were generating"
    else:
        pytest.fail("no attempt had two streams generating at once")
    # Both streams were dropped: the gateway serves again.
    end = time.monotonic() + 30
    while True:
        try:
            client.chat.completions.create(model=topology.model, messages=HELLO, max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.monotonic() < end, "the gateway stayed at capacity"
            time.sleep(0.2)


def _cancelled(topology: Any) -> float:
    worker = topology.procs["llm-1"]
    host = worker.address.rsplit(":", 1)[0]
    url = f"http://{host}:{worker.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    m = re.search(
        r'^omniflow_worker_requests_total\{finish_reason="cancelled"\} (\S+)$', text, re.M
    )
    return float(m.group(1)) if m else 0.0


def test_disconnect_aborts_the_worker_request(
    client: openai.OpenAI, topology: Any, http: httpx.Client
) -> None:
    before = _cancelled(topology)
    body = {"model": topology.model, "messages": LONG, "max_tokens": 500, "stream": True}
    body.update(temperature=0, stop=None)
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()
        got = [next(lines) for _ in range(6)]  # role chunk, then a few tokens
        assert any(line.startswith("data: {") for line in got)
    end = time.monotonic() + 30
    while _cancelled(topology) <= before:
        assert time.monotonic() < end, "the worker did not see the request cancelled"
        time.sleep(0.2)
    # And the gateway keeps serving.
    reply = client.chat.completions.create(model=topology.model, messages=HELLO, max_tokens=3)
    assert reply.choices[0].message.content


def test_request_ids(http: httpx.Client, topology: Any) -> None:
    reply = http.get("/v1/models")
    rid = reply.headers["x-request-id"]
    assert re.fullmatch(r"req-[0-9a-f]{32}", rid)
    assert http.get("/v1/models").headers["x-request-id"] != rid
    mine = http.post(
        "/v1/chat/completions",
        json={"model": topology.model, "messages": HELLO, "max_tokens": 1},
        headers={"x-request-id": "client-chosen-1"},
    )
    assert mine.headers["x-request-id"] == "client-chosen-1"
    assert "client-chosen-1" not in mine.json()["id"]  # the response's own id is the server's
    assert http.get("/v1/nowhere").headers["x-request-id"]  # errors carry one too
    assert http.get("/v1/nowhere").json()["error"]["message"].startswith("no route")
