"""Unit tests (no network): request validation names the field, the error table, sizes and
prompt shapes, and the chunk shape OpenAI streams."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from omniflow import errors
from omniflow.sampling import SamplingError
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
        ({"model": "m", "messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        (
            {"model": "m", "messages": HELLO, "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        ({"model": "m", "messages": HELLO, "n": 0}, "n"),
        ({"model": "m", "messages": []}, "messages"),
        ({"messages": HELLO}, "model"),
    ],
)
def test_chat_validation_names_the_field(body: dict, param: str) -> None:
    assert _param(ChatCompletionRequest, body) == param


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"logit_bias": {"x": 2}}, "logit_bias"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"top_p": 0}, "top_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_errors_name_the_field(extra: dict, field: str) -> None:
    """Ranges are the contract's: the request parses, its sampling names the bad field."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **extra})
    with pytest.raises(SamplingError) as err:
        req.to_sampling_params()
    assert err.value.field == field
    assert from_domain(err.value).status == 400 and from_domain(err.value).param == field


def test_completion_validation() -> None:
    echo = CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True})
    assert echo.echo and echo.to_sampling_params().max_tokens == 16  # vLLM's default
    null = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None})
    assert null.to_sampling_params().max_tokens == 16  # null is the default (vLLM 0.32)
    only = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "echo": True, "max_tokens": 0}
    )
    assert only.echo_only and only.to_sampling_params().max_tokens == 1  # shown: the prompt
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
