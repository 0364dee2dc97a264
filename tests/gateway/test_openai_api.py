"""The gateway against the official `openai` client, on a real topology serving SmolLM2:
greedy output equals transformers' `generate` on `apply_chat_template`, token counts
equal the template's, a second turn reuses KV, `n`, completions, workflows as models."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from omniflow.client import Client
from omniflow.dsl import VType, Workflow

pytestmark = pytest.mark.integration

MAX_TOKENS = 10
PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate. Answer briefly."},
        {"role": "user", "content": "Say hello to my friend."},
    ],
    [{"role": "user", "content": "Name three colors."}],
]


@pytest.fixture(scope="module")
def client(topology: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=topology.base_url, api_key=topology.api_key, max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI, topology: Any) -> None:
    ids = [m.id for m in client.models.list().data]
    assert topology.model in ids
    assert client.models.retrieve(topology.model).id == topology.model


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_chat_greedy_equals_transformers(
    client: openai.OpenAI, reference: Any, topology: Any, prompt: int
) -> None:
    messages = PROMPTS[prompt]
    ids = reference.chat_ids(messages)
    want = reference.text(reference.generate(ids, MAX_TOKENS))
    reply = client.chat.completions.create(
        model=topology.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == want
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens <= MAX_TOKENS
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    # Streamed, the same text, piece by piece, with usage at the end when asked.
    stream = client.chat.completions.create(
        model=topology.model,
        messages=messages,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)


def test_async_client_streaming_and_not(reference: Any, topology: Any) -> None:
    messages = PROMPTS[1]
    want = reference.text(reference.generate(reference.chat_ids(messages), MAX_TOKENS))

    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(
            base_url=topology.base_url, api_key=topology.api_key, max_retries=0
        )
        try:
            whole = await aclient.chat.completions.create(
                model=topology.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            stream = await aclient.chat.completions.create(
                model=topology.model,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return whole.choices[0].message.content or "", "".join(parts)
        finally:
            await aclient.close()

    whole, streamed = asyncio.run(run())
    assert whole == want
    assert streamed == want


def test_second_turn_reports_cached_tokens(client: openai.OpenAI, topology: Any) -> None:
    first = [{"role": "user", "content": "Tell me one fact about the Moon, please."}]
    a = client.chat.completions.create(
        model=topology.model, messages=first, max_tokens=MAX_TOKENS, temperature=0
    )
    second = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "And one about Mars?"},
    ]
    b = client.chat.completions.create(
        model=topology.model, messages=second, max_tokens=4, temperature=0
    )
    assert b.usage.prompt_tokens > a.usage.prompt_tokens
    assert b.usage.prompt_tokens_details.cached_tokens > 0
    assert b.usage.prompt_tokens_details.cached_tokens % 16 == 0  # whole pages


def test_n_returns_that_many_choices(client: openai.OpenAI, topology: Any) -> None:
    reply = client.chat.completions.create(
        model=topology.model,
        messages=PROMPTS[2],
        max_tokens=6,
        temperature=1.0,
        seed=7,
        n=2,
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.content for c in reply.choices)
    again = client.chat.completions.create(
        model=topology.model, messages=PROMPTS[2], max_tokens=6, temperature=1.0, seed=7, n=2
    )
    # A seed makes the choices reproducible (each choice has its own seed).
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_stop_string_cuts_the_answer(client: openai.OpenAI, reference: Any, topology: Any) -> None:
    messages = PROMPTS[0]
    want = reference.text(reference.generate(reference.chat_ids(messages), MAX_TOKENS))
    word = want.split()[1]
    reply = client.chat.completions.create(
        model=topology.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stop=[word]
    )
    assert reply.choices[0].message.content == want[: want.index(word)]
    assert reply.choices[0].finish_reason == "stop"


def test_logprobs_equal_transformers(client: openai.OpenAI, reference: Any, topology: Any) -> None:
    messages = PROMPTS[0]
    ids = reference.chat_ids(messages)
    new = reference.generate(ids, 4)
    reply = client.chat.completions.create(
        model=topology.model,
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    want = reference.logprobs(ids, new)
    assert [round(c.logprob, 3) for c in content] == pytest.approx(
        [round(w, 3) for w in want], abs=2e-3
    )
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)  # greedy


def test_completions_text_and_tokens(client: openai.OpenAI, reference: Any, topology: Any) -> None:
    prompt = "The three primary colors are"
    ids = reference.encode(prompt)
    want = reference.text(reference.generate(ids, 6))
    reply = client.completions.create(
        model=topology.model, prompt=prompt, max_tokens=6, temperature=0
    )
    assert reply.choices[0].text == want
    assert reply.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(
        model=topology.model, prompt=ids, max_tokens=6, temperature=0
    )
    assert by_ids.choices[0].text == want
    stream = client.completions.create(
        model=topology.model, prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_workflow_is_a_model(client: openai.OpenAI, topology: Any) -> None:
    wf = Workflow("gw-answer", description="one llm call")
    question = wf.input("question", VType.TEXT)
    node = wf.call(
        "answer", "llm", "generate", prompt=question, params={"max_tokens": 6, "temperature": 0.0}
    )
    wf.output("answer", node["text"])

    async def register() -> None:
        async with Client(topology.procs["coordinator"].address) as c:
            await c.register(wf)

    asyncio.run(register())
    assert "workflow:gw-answer" in [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": "What is a cache?"}]
    whole = client.chat.completions.create(model="workflow:gw-answer", messages=messages)
    assert whole.choices[0].message.content
    streamed = client.chat.completions.create(
        model="workflow:gw-answer", messages=messages, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content  # greedy node: the same answer


def _png(color: tuple[int, int, int]) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 48), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_in_chat_reuses_its_kv_on_a_second_turn(client: openai.OpenAI, topology: Any) -> None:
    content = [
        {"type": "image_url", "image_url": {"url": _png((200, 30, 30))}},
        {"type": "text", "text": "What is in this image?"},
    ]
    messages = [{"role": "user", "content": content}]
    first = client.chat.completions.create(
        model=topology.model, messages=messages, max_tokens=4, temperature=0
    )
    again = client.chat.completions.create(
        model=topology.model, messages=messages, max_tokens=4, temperature=0
    )
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    # The image span's pages come from the cache the second time.
    assert again.usage.prompt_tokens_details.cached_tokens > (
        first.usage.prompt_tokens_details.cached_tokens
    )


def test_images_generations(client: openai.OpenAI, topology: Any) -> None:
    import base64
    import io

    from PIL import Image

    reply = client.images.generate(
        model=topology.diffusion, prompt="a red square", size="32x32", n=2, extra_body={"seed": 3}
    )
    assert len(reply.data) == 2
    for item in reply.data:
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert image.format == "PNG" and image.size == (32, 32)
    with pytest.raises(openai.NotFoundError):  # served by llm workers, not by a diffusion one
        client.images.generate(model="smollm2-135m-instruct", prompt="x")


def test_audio_speech_is_wav(client: openai.OpenAI, topology: Any) -> None:
    import io
    import wave

    reply = client.audio.speech.create(
        model=topology.talker, input="Hello from the gateway.", voice="", response_format="wav"
    )
    with wave.open(io.BytesIO(reply.read())) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        assert w.getnframes() > 0
