"""Templates of other families against transformers' ``apply_chat_template``: a Llama-3-style
template (header tokens, ``{{ bos_token }}`` in the template while the tokenizer's own
post-processor also adds BOS, ``strftime_now``, content as a list of parts) and a
Mistral-style one (SentencePiece-style tokenizer, a list of named templates, roles that
must alternate or the template raises)."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from omniflow.chat import ChatTemplate, Preprocessor
from omniflow.errors import InvalidArgument

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")

NS = b"\x01" * 16

LLAMA_CHATS = {
    "user": [{"role": "user", "content": "Hello there, how are you?"}],
    "system": [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And the cache of layer 3?"},
    ],
    "parts": [
        {"role": "user", "content": [{"type": "text", "text": "Describe "}]},
        {"role": "assistant", "content": "Which one?"},
        {
            "role": "user",
            "content": [{"type": "text", "text": " the first "}, {"type": "text", "text": "key"}],
        },
    ],
}

MISTRAL_CHATS = {
    "user": [{"role": "user", "content": "Hello there"}],
    "system": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! What do you need?"},
        {"role": "user", "content": "A page of keys and values"},
    ],
}


def hf_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    return list(
        tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )


@pytest.fixture(scope="module")
def llama(llama3_dir: Path):
    return (
        Preprocessor.from_folder(llama3_dir, NS),
        transformers.AutoTokenizer.from_pretrained(llama3_dir),
    )


@pytest.fixture(scope="module")
def mistral(mistral_dir: Path):
    return (
        Preprocessor.from_folder(mistral_dir, NS),
        transformers.AutoTokenizer.from_pretrained(mistral_dir),
    )


@pytest.mark.parametrize("gen", [True, False], ids=["generation-prompt", "no-generation-prompt"])
@pytest.mark.parametrize("name", list(LLAMA_CHATS))
def test_llama3_style_ids_equal_apply_chat_template(llama, name, gen):
    pre, ref = llama
    messages = LLAMA_CHATS[name]
    ids = pre.encode_chat(messages, gen)
    assert ids == hf_ids(ref, messages, gen)
    bos = ref.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS, not added twice
    assert pre.template is not None and pre.template.content_format == "openai"


def test_llama3_style_text_prompt_gets_the_tokenizer_bos(llama):
    pre, ref = llama
    text = "Once upon a time"
    assert pre.encode_text(text) == ref(text).input_ids
    assert pre.encode_text(text)[0] == ref.convert_tokens_to_ids("<|begin_of_text|>")


def test_llama3_style_eos_ids_are_all_of_generation_config(llama):
    pre, ref = llama
    assert set(pre.eos_token_ids) == {
        ref.convert_tokens_to_ids("<|eot_id|>"),
        ref.convert_tokens_to_ids("<|end_of_text|>"),
    }


def test_media_parts_stay_in_place_as_placeholders(llama):
    pre, ref = llama
    with_image = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": " and listen "},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            ],
        }
    ]
    as_text = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "text", "text": "<|image|>"},
                {"type": "text", "text": " and listen "},
                {"type": "text", "text": "<|audio|>"},
            ],
        }
    ]
    text = pre.render_chat(with_image)
    assert "Look:<|image|>and listen<|audio|><|eot_id|>" in text  # the template trims parts
    assert text == ref.apply_chat_template(as_text, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("gen", [True, False], ids=["generation-prompt", "no-generation-prompt"])
@pytest.mark.parametrize("name", list(MISTRAL_CHATS))
def test_mistral_style_ids_equal_apply_chat_template(mistral, name, gen):
    pre, ref = mistral
    messages = MISTRAL_CHATS[name]
    assert pre.encode_chat(messages, gen) == hf_ids(ref, messages, gen)
    assert pre.encode_text(" A page") == ref(" A page").input_ids


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [{"role": "assistant", "content": "I start"}],
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
    ],
    ids=["two-users", "assistant-first", "assistant-after-system"],
)
def test_a_template_that_raises_gives_invalid_argument_with_its_message(mistral, messages):
    pre, ref = mistral
    with pytest.raises(jinja2.exceptions.TemplateError) as hf:
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidArgument) as ours:
        pre.encode_chat(messages)
    assert str(hf.value) in str(ours.value)
    assert "roles must alternate" in str(ours.value)
    assert pre.model in str(ours.value)


def test_tojson_does_not_escape_html_or_unicode():
    tpl = ChatTemplate(
        "{% for m in messages %}{{ m | tojson }}{{ m['content'] | tojson(indent=1) }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "<b>é & ü</b>"}]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    assert "\\u003c" in env.from_string("{{ x | tojson }}").render(x="<")  # jinja's own escapes
    assert tpl.render(messages) == '{"role": "user", "content": "<b>é & ü</b>"}"<b>é & ü</b>"'


def test_special_tokens_and_keyword_arguments_reach_the_template():
    tpl = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ extra }}|{{ add_generation_prompt }}",
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert tpl.render([{"role": "user", "content": "x"}], extra=3) == "<s>|</s>|3|True"
    assert tpl.render([{"role": "user", "content": "x"}], False, bos_token="B").startswith("B|")


def test_a_template_that_does_not_compile_names_the_model():
    with pytest.raises(InvalidArgument, match=r"chat template of m1 does not compile"):
        ChatTemplate("{% for m in messages %}", model="m1")


def test_the_sandbox_refuses_unsafe_attribute_access():
    tpl = ChatTemplate("{{ messages.__class__.__mro__ }}", model="m2")
    with pytest.raises(InvalidArgument, match="chat template of m2"):
        tpl.render([{"role": "user", "content": "x"}])


# Qwen2.5-style tool section: ``tools is not none`` must be false when no tools are given.
TOOLS_TEMPLATE = """{%- if tools is not none %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n# Tools\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson }}{{- '\\n' }}
    {%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no-tools", "tools"])
def test_tools_are_none_unless_given_as_in_transformers(llama, tools):
    pre, ref = llama
    ours = ChatTemplate(TOOLS_TEMPLATE, pre.template.special_tokens)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    want = ref.apply_chat_template(
        messages,
        tools=tools,
        chat_template=TOOLS_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert ours.render(messages, tools=tools) == want
    assert ("# Tools" in want) == (tools is not None)


def test_has_media():
    from omniflow.chat import has_media

    assert not has_media([{"role": "user", "content": "hi"}])
    assert not has_media([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert has_media([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert has_media([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_dict_and_namespace_globals_work_as_in_transformers(llama):
    _, ref = llama
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}|{{ dict(a=1) | tojson }}|{{ dict.fromkeys(['x'], 2) | tojson }}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    want = ref.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert ChatTemplate(source).render(messages) == want == '2|{"a": 1}|{"x": 2}'
    with pytest.raises(InvalidArgument, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(messages)
