"""Incremental detokenization with stop strings.

Each output token goes through a ``tokenizers.decoders.DecodeStream`` primed with the
prompt's last tokens: a chunk is the text the token adds after what came before, so the
streamed text equals the decoded whole, a SentencePiece-style (Metaspace) first token keeps
its leading space (decoded alone, its "▁" would be stripped as the start of a text), and an
incomplete UTF-8 sequence waits for the token that completes it. When stop strings are set,
the last ``max(len(stop)) - 1`` characters are held back, since they might be the start of a
stop string. As vLLM's detokenizer: the stop string is cut from the text (kept, and the text
cut after it, with ``include_stop_str_in_output``), and no stop string is looked for in the
text of the first ``min_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from omniflow.sampling import SamplingParams

#: Prompt tokens the stream is primed with: enough context for a word boundary.
PRIME_TOKENS = 8


class Detokenizer:
    """Text of one request's output tokens, as they come.

    ``params`` is the request's contract: its ``stop`` strings, ``include_stop_str_in_output``,
    ``min_tokens`` and ``skip_special_tokens``. ``prompt`` is the request's prompt ids (the
    tail primes the stream); ids outside the vocabulary (multimodal pad ids) are left out of
    the priming.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._stop = params.stop
        self._keep_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._count = 0
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        tail = [t for t in prompt[-PRIME_TOKENS:] if 0 <= t < vocab]
        self._stream = DecodeStream(ids=tail, skip_special_tokens=params.skip_special_tokens)
        self._vocab = vocab
        self.text = ""
        self._emitted = 0

    def add(self, token_id: int) -> bool:
        """Add one output token; True when the text now contains a stop string (text cut)."""
        self._count += 1
        if not 0 <= token_id < self._vocab:
            return False
        chunk = self._stream.step(self._tok, token_id)
        if not chunk:
            return False
        start = len(self.text)
        self.text += chunk
        if self._stop and self._count > self._min_tokens:
            base = max(0, start - self._hold)
            window = self.text[base:]
            hits = [(h, len(s)) for h, s in ((window.find(s), s) for s in self._stop) if h >= 0]
            if hits:
                at, length = min(hits)
                self.text = self.text[: base + at + (length if self._keep_stop else 0)]
                return True
        return False

    def delta(self, final: bool) -> str:
        """Text not yet returned; keeps back a possible stop-string prefix unless ``final``."""
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
