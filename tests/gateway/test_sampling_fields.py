"""vLLM's sampling fields through the gateway, with the official `openai` client, on the real
topology serving SmolLM2: fixed-length generation (`ignore_eos`), no 64-token cap, `echo`,
stop strings kept or cut, special tokens kept or skipped, `logit_bias` and `min_tokens`
against transformers' own processors, and the sampling fields of workflow models.
(Greedy equality with vLLM's own server, field by field, is tests/vllm/test_vllm_parity.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from omniflow.client import Client
from omniflow.dsl import VType, Workflow

pytestmark = pytest.mark.integration

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def client(topology: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=topology.base_url, api_key=topology.api_key, max_retries=0)


def _chat(client: openai.OpenAI, model: str, messages: Any, **kw: Any) -> Any:
    extra = {k: kw.pop(k) for k in list(kw) if k in _VLLM_FIELDS}
    return client.chat.completions.create(
        model=model, messages=messages, temperature=0, extra_body=extra or None, **kw
    )


_VLLM_FIELDS = (
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
)


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_gives_exactly_max_tokens(
    client: openai.OpenAI, topology: Any, stream: bool
) -> None:
    """aiperf's fixed-length rows: `ignore_eos: true` with max_tokens N is N tokens."""
    n = 40  # the capital of France is answered in fewer: EOS would end it early
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=topology.model,
                messages=CAPITAL,
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        usage = chunks[-1].usage
        finals = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert usage is not None and usage.completion_tokens == n and finals == ["length"]
    else:
        reply = _chat(client, topology.model, CAPITAL, max_tokens=n, ignore_eos=True)
        assert reply.usage.completion_tokens == n
        assert reply.choices[0].finish_reason == "length"
    free = _chat(client, topology.model, CAPITAL, max_tokens=n)
    assert free.usage.completion_tokens < n and free.choices[0].finish_reason == "stop"
    comp = client.completions.create(
        model=topology.model,
        prompt="The capital of France is",
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert comp.usage.completion_tokens == n


def test_no_max_tokens_is_not_capped(client: openai.OpenAI, topology: Any) -> None:
    """Unset max_tokens means up to the context (it stopped at 64 before): min_tokens keeps
    stop strings and EOS off for 80 tokens, then the first "." ends it."""
    reply = _chat(client, topology.model, STORY, min_tokens=80, stop=["."])
    assert reply.usage.completion_tokens >= 80
    assert reply.choices[0].finish_reason == "stop"


def test_min_tokens_equals_transformers(
    client: openai.OpenAI, topology: Any, reference: Any
) -> None:
    ids = reference.chat_ids(CAPITAL)
    eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    free = reference.generate(ids, 60, eos_token_id=eos)
    assert len(free) < 30, "the reference answer should end early for this test"
    want = reference.generate(ids, 60, eos_token_id=eos, min_new_tokens=30)
    reply = _chat(client, topology.model, CAPITAL, max_tokens=60, min_tokens=30)
    got = reply.usage.completion_tokens
    assert got >= 30
    text = reference.tokenizer.decode([t for t in want if t != eos], skip_special_tokens=True)
    assert reply.choices[0].message.content == text and got == len(want)


def test_logit_bias_equals_transformers(
    client: openai.OpenAI, topology: Any, reference: Any
) -> None:
    ids = reference.chat_ids(CAPITAL)
    eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = reference.generate(ids, 1, eos_token_id=eos)[0]
    banned = {(first,): -100.0}
    want = reference.generate(ids, 12, eos_token_id=eos, sequence_bias=banned)
    assert want[0] != first
    reply = client.chat.completions.create(
        model=topology.model,
        messages=CAPITAL,
        max_tokens=12,
        temperature=0,
        logit_bias={str(first): -100},
    )
    text = reference.tokenizer.decode([t for t in want if t != eos], skip_special_tokens=True)
    assert reply.choices[0].message.content == text


def test_stop_strings_are_cut_or_kept(client: openai.OpenAI, topology: Any) -> None:
    full = _chat(client, topology.model, STORY, max_tokens=30).choices[0].message.content
    words = full.split()
    word = next(w for w in words[3:] if w.isalpha() and len(w) > 3)
    head = full[: full.index(word)]
    cut = _chat(client, topology.model, STORY, max_tokens=30, stop=[word])
    assert cut.choices[0].message.content == head and cut.choices[0].finish_reason == "stop"
    kept = _chat(
        client, topology.model, STORY, max_tokens=30, stop=[word], include_stop_str_in_output=True
    )
    assert kept.choices[0].message.content == head + word


def test_special_tokens_are_kept_when_asked(client: openai.OpenAI, topology: Any) -> None:
    """The EOS that ends an answer is left out of the text, unless
    include_stop_str_in_output; its text then shows with skip_special_tokens false."""
    plain = _chat(client, topology.model, CAPITAL, max_tokens=40)
    assert plain.choices[0].finish_reason == "stop"
    answer = plain.choices[0].message.content
    kept = _chat(
        client,
        topology.model,
        CAPITAL,
        max_tokens=40,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    assert kept.choices[0].message.content == answer + "<|im_end|>"
    skipped = _chat(client, topology.model, CAPITAL, max_tokens=40, include_stop_str_in_output=True)
    assert skipped.choices[0].message.content == answer
    ids = _chat(client, topology.model, CAPITAL, max_tokens=40, skip_special_tokens=False)
    assert ids.choices[0].message.content == answer  # the stop token's text is cut


def test_completions_echo(client: openai.OpenAI, topology: Any, reference: Any) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(
        model=topology.model, prompt=prompt, max_tokens=5, temperature=0
    )
    echoed = client.completions.create(
        model=topology.model, prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = client.completions.create(
        model=topology.model, prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    ids = reference.tokenizer(prompt)["input_ids"]
    by_ids = client.completions.create(
        model=topology.model, prompt=ids, max_tokens=5, temperature=0, echo=True
    )
    assert by_ids.choices[0].text == reference.tokenizer.decode(ids) + plain.choices[0].text


def _register(topology: Any, wf: Workflow) -> None:
    async def go() -> None:
        async with Client(topology.procs["coordinator"].address) as c:
            await c.register(wf)

    asyncio.run(go())


def test_workflow_models_take_the_chat_sampling_fields(
    client: openai.OpenAI, topology: Any
) -> None:
    """temperature, top_p, max_tokens, seed and stop go to the llm node that answers."""
    wf = Workflow("gw-sampled", description="one llm call, greedy, 24 tokens")
    node = wf.call(
        "answer",
        "llm",
        "generate",
        prompt=wf.input("question", VType.TEXT),
        params={"chat": True, "max_tokens": 24, "temperature": 0.0},
    )
    wf.output("answer", node["text"])
    _register(topology, wf)
    model = "workflow:gw-sampled"

    def ask(**kw: Any) -> str:
        reply = client.chat.completions.create(model=model, messages=STORY, **kw)
        return reply.choices[0].message.content or ""

    greedy = ask()
    # The workflow's llm node as a plain chat call with the node's params: the same text.
    same = _chat(client, topology.model, STORY, max_tokens=24).choices[0].message.content
    assert greedy == same
    short = ask(max_tokens=4)
    assert greedy.startswith(short) and len(short) < len(greedy)
    word = next(w for w in greedy.split()[2:] if w.isalpha() and len(w) > 3)
    assert ask(stop=[word]) == greedy[: greedy.index(word)]
    hot = ask(temperature=1.5, top_p=0.95, seed=7)
    assert hot == ask(temperature=1.5, top_p=0.95, seed=7)  # seeded: reproducible
    assert hot != greedy
    with pytest.raises(openai.BadRequestError) as err:
        ask(extra_body={"top_k": 5})
    assert err.value.response.json()["error"]["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as err:
        ask(temperature=101)
    assert err.value.response.json()["error"]["param"] == "temperature"
