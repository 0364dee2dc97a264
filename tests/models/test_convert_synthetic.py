"""The converter on GGUF files written from tiny random HF models (Qwen2 with QKV bias and tied
embeddings; Llama untied, with llama.cpp's Q/K permutation): transformers' GGUF loader reads
the same files as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_writer_helpers import write_gguf

from omniflow.models import make_tiny
from omniflow.models.gguf_convert import convert_gguf

CASES = {"qwen2": ("qwen2", {}), "llama": ("llama-bpe", {"tie_embeddings": False})}
TEXTS = [
    "Hello world, hello tokenizer",
    "numbers 12345 and 3.14, it's   spaced\n\nlines\t",
    "ünïcödé 日本 🙂 <|im_start|>user\nhi<|im_end|>\n",
]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_converted_equals_transformers_gguf_loader(arch: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the reference is transformers")
    pytest.importorskip("gguf", reason="the converter reads GGUF files with gguf-py")
    torch.set_num_threads(1)
    pre, kw = CASES[arch]
    tiny = make_tiny(arch, tmp_path / "tiny", vocab=384, **kw)
    gguf_file = write_gguf(tiny, tmp_path / f"{arch}.gguf", pre=pre, quantize=arch == "qwen2")
    ours = convert_gguf(gguf_file, tmp_path / "converted")

    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
    our_tok = transformers.AutoTokenizer.from_pretrained(ours)
    for text in TEXTS:
        assert our_tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
    assert our_tok.chat_template == ref_tok.chat_template

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ids = torch.tensor([our_tok("Hello world, it's a test of 42 tokens")["input_ids"]])
    with torch.no_grad():
        got = model(ids).logits
        torch.testing.assert_close(got, ref(ids).logits, atol=1e-4, rtol=0)
        if arch == "llama":  # unquantized: the permutation is undone exactly
            torch.testing.assert_close(got, original(ids).logits, atol=1e-5, rtol=0)
        else:  # Q8_0 keeps the model close to the original (a few % of the logit range)
            want = original(ids).logits
            assert (got - want).abs().max() < 0.1 * want.abs().max()
