"""Unit tests (no network): request validation names the field, the error table, sizes and
prompt shapes, and the chunk shape OpenAI streams."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from omniflow import errors
from omniflow_services.gateway.errors import APIError, from_domain, from_validation
from omniflow_services.gateway.openai_api import _prompts, _size
from omniflow_services.gateway.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    CompletionRequest,
    Delta,
)


def _param(cls: type, body: dict) -> str | None:
    with pytest.raises(ValidationError) as err:
        cls.model_validate_json(json.dumps(body))
    return from_validation(err.value).param


HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": HELLO, "tools": []}, "tools"),
        ({"model": "m", "messages": HELLO, "logit_bias": {"1": 2}}, "logit_bias"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x", "name": "a"}]},
            "messages[0].name",
        ),
        ({"model": "m", "messages": HELLO, "temperature": -1}, "temperature"),
        ({"model": "m", "messages": HELLO, "top_logprobs": 21}, "top_logprobs"),
        ({"model": "m", "messages": HELLO, "n": 0}, "n"),
        ({"model": "m", "messages": []}, "messages"),
        ({"messages": HELLO}, "model"),
    ],
)
def test_chat_validation_names_the_field(body: dict, param: str) -> None:
    assert _param(ChatCompletionRequest, body) == param


def test_completion_validation() -> None:
    assert _param(CompletionRequest, {"model": "m", "prompt": "x", "echo": True}) == "echo"
    assert _param(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "y"}) == "suffix"
    ok = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]})
    assert _prompts(ok.prompt) == [[1, 2, 3]]
    assert _prompts(["a", "b"]) == ["a", "b"]
    with pytest.raises(APIError) as err:
        _prompts([])
    assert err.value.param == "prompt"


def test_domain_errors_map_to_statuses() -> None:
    for exc, status in (
        (errors.InvalidArgument("x"), 400),
        (errors.NotFound("x"), 404),
        (errors.ResourceExhausted("x"), 429),
        (errors.Unavailable("x"), 503),
        (errors.DeadlineExceeded("x"), 504),
        (errors.OmniflowError("x"), 500),
    ):
        assert from_domain(exc).status == status


def test_sizes() -> None:
    assert _size("64x32") == (64, 32)
    for bad in ("64", "0x10", "axb", "4096x4096"):
        with pytest.raises(APIError) as err:
            _size(bad)
        assert err.value.param == "size"


def test_chunk_delta_carries_only_its_fields() -> None:
    chunk = ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[
            ChunkChoice(index=0, delta=Delta(content="a")),
            ChunkChoice(index=0, delta=Delta(), finish_reason="stop"),
        ],
    )
    data = json.loads(chunk.model_dump_json())
    assert data["choices"][0]["delta"] == {"content": "a"}
    assert data["choices"][1]["delta"] == {} and data["choices"][1]["finish_reason"] == "stop"
    assert data["choices"][0]["finish_reason"] is None and data["object"] == "chat.completion.chunk"
