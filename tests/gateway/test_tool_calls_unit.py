"""The gateway's tool plan and answers without a network: what ``tools``/``tool_choice``
make of a request, and an answer's text as ``message.tool_calls`` or streamed deltas (the
same calls both ways, whatever the text's chunking)."""

from __future__ import annotations

import json

import pytest

from omniflow_services.gateway.errors import APIError
from omniflow_services.gateway.protocol import ChatCompletionRequest
from omniflow_services.gateway.tool_calls import StreamedCalls, plan_tools, whole_answer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TWO_CALLS = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def request(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def streamed(plan, text: str, size: int) -> tuple[str, dict[int, dict]]:
    """Content and calls (by index) of ``text`` streamed in pieces of ``size`` characters,
    joined as the openai SDK joins deltas."""
    s = StreamedCalls(plan)
    deltas = [d for i in range(0, len(text), size) for d in s.feed(text[i : i + size])]
    deltas += s.end()
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls or ():
            slot = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = slot["id"] or c.id
            slot["name"] += (c.function.name or "") if c.function else ""
            slot["arguments"] += (c.function.arguments or "") if c.function else ""
    return content, calls


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_auto_calls_are_the_same_whole_and_streamed(size: int) -> None:
    plan = plan_tools(request(tools=[WEATHER, TIME]), "hermes")
    assert plan is not None and plan.choice == "auto" and plan.constraint is None
    content, calls = whole_answer(plan, TWO_CALLS)
    assert content == "Sure.\n" and [c.function.name for c in calls] == ["get_weather", "get_time"]
    text, streamed_calls = streamed(plan, TWO_CALLS, size)
    assert text == "Sure.\n"
    assert [(v["name"], json.loads(v["arguments"])) for v in streamed_calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]
    assert all(v["id"].startswith("call_") for v in streamed_calls.values())


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    plan = plan_tools(request(tools=[WEATHER, TIME], parallel_tool_calls=False), "hermes")
    assert plan is not None
    _, calls = whole_answer(plan, TWO_CALLS)
    assert [c.function.name for c in calls] == ["get_weather"]
    _, streamed_calls = streamed(plan, TWO_CALLS, 4)
    assert [v["name"] for v in streamed_calls.values()] == ["get_weather"]
    required = plan_tools(
        request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), "hermes"
    )
    assert required is not None and required.constraint is not None
    assert json.loads(required.constraint.structured.spec)["maxItems"] == 1


def test_a_named_function_streams_its_arguments_in_fragments() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(request(tools=[WEATHER], tool_choice=named), "hermes")
    assert plan is not None and plan.constraint is not None
    schema = json.loads(plan.constraint.structured.spec)
    assert schema == WEATHER["function"]["parameters"]
    args = '{"city": "Lima"}'
    content, calls = streamed(plan, args, 2)
    assert content == "" and calls == {
        0: {"id": calls[0]["id"], "name": "get_weather", "arguments": args}
    }
    none, whole = whole_answer(plan, args)
    assert none is None and json.loads(whole[0].function.arguments) == {"city": "Lima"}
    # Cut short (not JSON): no call, the text stays the content.
    assert whole_answer(plan, '{"ci') == ('{"ci', [])


def test_plans_refuse_what_cannot_be_served() -> None:
    with pytest.raises(APIError) as info:
        plan_tools(request(tool_choice="required"), "hermes")
    assert info.value.param == "tool_choice"
    with pytest.raises(APIError) as info:
        plan_tools(request(tools=[WEATHER]), "none")
    assert info.value.param == "tools"
    assert plan_tools(request(), "hermes") is None
    plan = plan_tools(request(tools=[WEATHER], tool_choice="none"), "hermes")
    assert plan is not None and whole_answer(plan, TWO_CALLS) == (TWO_CALLS, [])
