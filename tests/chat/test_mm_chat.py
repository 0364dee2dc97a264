"""Media inside a templated chat: each item is a placeholder in its message's content when
the model's template renders (SmolLM2's, default system turn included); the prompt's ids are
the reference tokenizer's ids of the text around it, with the item's span of pad ids there."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from omniflow.chat import Preprocessor
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import item_id, pad_id
from omniflow_services.worker.mm.prompt import ItemEmbeddings, build_prompt, chat_segments

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")

NS = bytes(16)


def _item(raw: bytes, n: int, kind: str) -> ItemEmbeddings:
    async def fetch() -> torch.Tensor:
        raise AssertionError("not fetched: only the ids are checked")

    return ItemEmbeddings(item_id(raw), n, fetch, "item", kind)


def _ids(pre: Preprocessor, turns, gen: bool = True) -> list[int]:
    assert pre.template is not None
    loop = asyncio.new_event_loop()
    try:
        segs = chat_segments(turns, gen, pre.template)
        return build_prompt(segs, pre.encode_piece, 16, loop, 64).tokens
    finally:
        loop.close()


def test_media_parts_keep_their_place_under_the_model_template(smollm2_tokenizer_dir: Path):
    pre = Preprocessor.from_folder(smollm2_tokenizer_dir, NS)
    ref = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    img, wav = _item(b"picture" * 9, 20, "image"), _item(b"sound" * 9, 7, "audio")
    turns = [
        ("user", ["Look: ", img, " and listen: ", wav, " what is it?"]),
        ("assistant", ["A cat purring."]),
        ("user", ["Sure?"]),
    ]
    ids = _ids(pre, turns)
    text = ref.apply_chat_template(
        [
            {"role": "user", "content": "Look: <|image|> and listen: <|audio|> what is it?"},
            {"role": "assistant", "content": "A cat purring."},
            {"role": "user", "content": "Sure?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    before, rest = text.split("<|image|>")
    middle, after = rest.split("<|audio|>")

    def tok(s: str) -> list[int]:
        return ref(s, add_special_tokens=False).input_ids

    want = (
        tok(before)
        + [pad_id(img.item_id)] * 20
        + tok(middle)
        + [pad_id(wav.item_id)] * 7
        + tok(after)
    )
    assert ids == want


def test_a_text_part_holding_a_placeholder_is_refused(smollm2_tokenizer_dir: Path):
    pre = Preprocessor.from_folder(smollm2_tokenizer_dir, NS)
    img = _item(b"picture", 4, "image")
    with pytest.raises(InvalidArgument, match="rendered 2 media placeholders for 1 media part"):
        _ids(pre, [("user", ["<|image|> is here:", img])])


def test_a_text_prompt_with_media_keeps_the_tokenizer_bos(llama3_dir: Path):
    """A completion prompt with a placeholder gets the tokenizer's special tokens once, as
    the same text without media would (Llama-style: BOS from the post-processor)."""
    from omniflow_services.worker.mm.prompt import text_segments

    pre = Preprocessor.from_folder(llama3_dir, NS)
    ref = transformers.AutoTokenizer.from_pretrained(llama3_dir)
    bos = ref.convert_tokens_to_ids("<|begin_of_text|>")
    assert pre.text_affixes() == ([bos], [])
    assert pre.encode_text("Once upon") == ref("Once upon").input_ids
    img = _item(b"picture" * 5, 9, "image")
    loop = asyncio.new_event_loop()
    try:
        segs = text_segments("Once upon <|image|> a time", [img], ["image"])
        ids = build_prompt(segs, pre.encode_piece, 16, loop, 64, affixes=pre.text_affixes()).tokens
    finally:
        loop.close()

    def tok(s: str) -> list[int]:
        return ref(s, add_special_tokens=False).input_ids

    assert ids == [bos, *tok("Once upon "), *[pad_id(img.item_id)] * 9, *tok(" a time")]
