"""Tools, tool calls and the template fields of a chat request, against transformers'
``apply_chat_template``: a Qwen2.5-style template that takes ``tools`` renders them (and the
history's calls and results) exactly as transformers does; SmolLM2's template, which has no
tools, gets the hermes tool prompt; ``continue_final_message``, ``add_generation_prompt``
and ``chat_template_kwargs`` mean what they mean there. The hermes parser gives the same
calls whole and fed a character at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniflow.chat import Preprocessor
from omniflow.chat.tools import (
    CallStream,
    check_tools,
    forced_calls,
    forced_schema,
    parse_calls,
    parse_tool_formats,
    tool_format_for,
)
from omniflow.errors import InvalidArgument

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")

NS = bytes(16)

# Qwen2.5-style: tools as JSON lines in the system turn, calls as <tool_call> blocks with
# the arguments as an object (``tojson``), consecutive tool results in one user turn.
QWEN_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReturn each call as <tool_call>{\"name\": ..., " }}
    {{- "\"arguments\": ...}</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
            or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}

# An agent loop's history as the OpenAI API sends it: arguments as JSON text.
HISTORY = [
    {"role": "system", "content": "You help with travel."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:02"},
]


def as_transformers_expects(messages: list[dict]) -> list[dict]:
    """The history as Hugging Face templates are written for: arguments as objects."""
    out = []
    for m in messages:
        m = json.loads(json.dumps(m))
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        out.append(m)
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory, make_tokenizer_dir):
    folder = make_tokenizer_dir(
        tmp_path_factory.mktemp("qwen25-style"),
        metaspace=False,
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        cfg={"chat_template": QWEN_TEMPLATE},
    )
    return Preprocessor.from_folder(folder, NS), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer_dir: Path):
    pre = Preprocessor.from_folder(smollm2_tokenizer_dir, NS)
    return pre, transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.mark.parametrize(
    "messages",
    [HISTORY[:2], HISTORY, HISTORY[1:2]],
    ids=["question", "calls-and-results", "no-system"],
)
def test_a_template_with_tools_renders_as_transformers(qwen, messages) -> None:
    pre, ref = qwen
    assert pre.template is not None and pre.template.takes_tools
    tools = [WEATHER, TIME]
    want = ref.apply_chat_template(
        as_transformers_expects(messages), tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert pre.render_chat(messages, tools=tools) == want
    ids = ref.apply_chat_template(
        as_transformers_expects(messages), tools=tools, add_generation_prompt=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert pre.encode_chat(messages, tools=tools) == list(ids)
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in want or len(messages) < 3


def test_history_with_calls_but_no_tools_offered_renders_as_transformers(qwen) -> None:
    pre, ref = qwen
    want = ref.apply_chat_template(
        as_transformers_expects(HISTORY), add_generation_prompt=True, tokenize=False
    )
    assert pre.render_chat(HISTORY) == want
    assert "<tools>" not in want


def test_a_template_without_tools_gets_the_hermes_tool_prompt(smollm2) -> None:
    pre, ref = smollm2
    assert pre.template is not None and not pre.template.takes_tools
    text = pre.render_chat(HISTORY, tools=[WEATHER, TIME])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou help with travel.\n\n")
    assert json.dumps(WEATHER) in system and "<tool_call></tool_call> XML tags" in system
    # Earlier calls as the model is asked to write them, results as one user turn.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}\n<tool_call>" in text
    results = (
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        "<tool_response>\n14:02\n</tool_response><|im_end|>"
    )
    assert results in text
    assert text.endswith("<|im_start|>assistant\n")
    # It is SmolLM2's own template over those messages: transformers renders them the same.
    from omniflow.chat.tools import template_messages

    plain = template_messages(HISTORY, [WEATHER, TIME], template_takes_tools=False)
    assert text == ref.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)


CONTINUE = [
    {"role": "user", "content": "Write a haiku about caches."},
    {"role": "assistant", "content": "Pages of the past  "},
]


@pytest.mark.parametrize("which", ["qwen", "smollm2", "llama"])
def test_continue_final_message_and_add_generation_prompt_as_transformers(
    which, request: pytest.FixtureRequest, llama3_dir: Path
) -> None:
    if which == "llama":
        pre = Preprocessor.from_folder(llama3_dir, NS)
        ref = transformers.AutoTokenizer.from_pretrained(llama3_dir)
    else:
        pre, ref = request.getfixturevalue(which)
    for gen, cont in ((False, True), (False, False), (True, False)):
        want = ref.apply_chat_template(
            CONTINUE, add_generation_prompt=gen, continue_final_message=cont, tokenize=False
        )
        got = pre.render_chat(CONTINUE, gen, continue_final_message=cont)
        assert got == want, (which, gen, cont)
    # The last turn is left open: no end-of-turn after its text.
    assert (
        pre.render_chat(CONTINUE, False, continue_final_message=True)
        .rstrip()
        .endswith("Pages of the past")
    )
    with pytest.raises(InvalidArgument, match="cannot both be true"):
        pre.render_chat(CONTINUE, True, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template_as_in_transformers(qwen) -> None:
    pre, ref = qwen
    chat = HISTORY[1:2]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs)
        assert pre.render_chat(chat, template_kwargs=kwargs) == want
    assert "<think>" in pre.render_chat(chat, template_kwargs={"enable_thinking": False})


# ------------------------------------------------------------------ parsing and choices

ANSWER = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)


def test_hermes_calls_parse_the_same_whole_and_streamed() -> None:
    content, calls = parse_calls(ANSWER)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    stream = CallStream()
    pieces = [p for ch in ANSWER for p in stream.feed(ch)] + stream.end()
    text = "".join(p for p in pieces if isinstance(p, str))
    assert text == content  # nothing of a tag leaks as text, nothing else is held back
    assert [(c.name, c.arguments) for c in pieces if not isinstance(c, str)] == [
        (c.name, c.arguments) for c in calls
    ]


def test_text_that_only_looks_like_a_call_stays_text() -> None:
    for text in ("a < b and <tool", "x <tool_call>not json</tool_call> y", "<tool_cal"):
        content, calls = parse_calls(text)
        assert content == text and calls == []


def test_tool_choice_checks_and_forced_schemas() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="the schema reference (dev extra)")
    tools = [WEATHER, TIME]
    assert check_tools(tools, None) == "auto" and check_tools(None, None) == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tools(tools, named) == "function:get_weather"
    for bad, needle in (
        (({"type": "function", "function": {"name": "nope"}}), "not among tools"),
        ("required", "needs tools"),
    ):
        with pytest.raises(InvalidArgument, match=needle):
            check_tools(tools if bad != "required" else None, bad)
    schema = forced_schema(tools, "function:get_weather")
    assert schema == WEATHER["function"]["parameters"]
    req = forced_schema(tools, "required", parallel=False)
    answer = '[{"name": "get_weather", "parameters": {"city": "Lima"}}]'
    jsonschema.validate(json.loads(answer), req)
    with pytest.raises(jsonschema.ValidationError):  # one call at most without parallel
        jsonschema.validate(
            json.loads(answer[:-1] + ', {"name": "get_time", "parameters": {}}]'), req
        )
    (call,) = forced_calls(answer, "required")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lima"}
    (call,) = forced_calls('{"city": "Oslo"}', "function:get_weather")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert forced_calls('{"city": "Os', "function:get_weather") == []


def test_tool_formats_per_model() -> None:
    assert tool_format_for("*=hermes", "m") == "hermes"
    assert tool_format_for("m=none,*=hermes", "m") == "none"
    assert tool_format_for("", "m") == "hermes"
    with pytest.raises(ValueError, match="format one of hermes, none"):
        parse_tool_formats("m=mistral")
