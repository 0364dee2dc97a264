"""Streaming detokenization: the deltas joined equal the tokenizer's decode of all output ids
(the Hugging Face reference), multi-byte characters split across tokens included; a
SentencePiece-style first token keeps its leading space; stop strings cut the text."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from omniflow.chat import Preprocessor
from omniflow.sampling import SamplingParams
from omniflow_services.worker.engine.detok import Detokenizer

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")

NS = bytes(16)
ANSWER = " The capital of France is Paris. Ünïcödé: 東京, emoji 🚀🙂 and 'quotes' — done."


def stream(tok: Tokenizer, prompt: list[int], out: list[int], stop: tuple[str, ...] = ()):
    """(deltas, whether a stop string was hit) for ``out`` fed one token at a time."""
    d = Detokenizer(tok, SamplingParams(stop=stop), prompt)
    deltas = []
    for i, t in enumerate(out):
        hit = d.add(t)
        deltas.append(d.delta(final=hit or i == len(out) - 1))
        if hit:
            return deltas, True
    return deltas, False


def test_smollm2_stream_equals_decode_of_the_whole(smollm2_tokenizer_dir: Path):
    pre = Preprocessor.from_folder(smollm2_tokenizer_dir, NS)
    ref = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    prompt = pre.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = [*pre.encode_piece(ANSWER), ref.eos_token_id]
    deltas, hit = stream(pre.tokenizer, prompt, out)
    assert not hit
    assert "".join(deltas) == ref.decode(out, skip_special_tokens=True) == ANSWER
    assert deltas[0].startswith(" The")  # the first token's leading space is kept
    # A token holding part of a UTF-8 character yields nothing until the character is whole.
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas


def test_metaspace_first_token_keeps_its_leading_space(mistral_dir: Path):
    pre = Preprocessor.from_folder(mistral_dir, NS)
    ref = transformers.AutoTokenizer.from_pretrained(mistral_dir)
    prompt = pre.encode_chat([{"role": "user", "content": "Say hello"}])
    out = pre.encode_piece("Hello world, keys and values")[:]
    assert ref.convert_ids_to_tokens(out[:1])[0].startswith("▁")
    deltas, _ = stream(pre.tokenizer, prompt, out)
    text = "".join(deltas)
    # Decoded alone, the first "▁" is stripped as the start of a text; after the prompt
    # it is a space, exactly as in the decode of prompt + output.
    whole = ref.decode(prompt + out, skip_special_tokens=True)
    head = ref.decode(prompt, skip_special_tokens=True)
    assert text == whole[len(head) :]
    assert text.startswith(" Hello")
    assert text.lstrip(" ") == ref.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("stop", "want"),
    [
        (("Paris",), " The capital of France is "),
        (("France is P", "capital"), " The "),
        (("東京",), " The capital of France is Paris. Ünïcödé: "),
        (("🙂",), " The capital of France is Paris. Ünïcödé: 東京, emoji 🚀"),
        (("not in the text",), ANSWER),
    ],
)
def test_stop_strings_cut_the_text(smollm2_tokenizer_dir: Path, stop, want):
    pre = Preprocessor.from_folder(smollm2_tokenizer_dir, NS)
    out = pre.encode_piece(ANSWER)
    deltas, hit = stream(pre.tokenizer, pre.encode_text("Q:"), out, stop)
    assert "".join(deltas) == want
    assert hit == (want != ANSWER)
    # Nothing of a stop string is ever streamed before the cut is known.
    for s in stop:
        assert all(s not in d for d in deltas)


def test_ids_outside_the_vocabulary_are_not_decoded(smollm2_tokenizer_dir: Path):
    pre = Preprocessor.from_folder(smollm2_tokenizer_dir, NS)
    pad = pre.tokenizer.get_vocab_size(with_added_tokens=True) + 7  # a multimodal pad id
    out = pre.encode_piece(" a cat")
    deltas, _ = stream(pre.tokenizer, [*pre.encode_text("look"), pad, pad], out)
    assert "".join(deltas) == " a cat"
