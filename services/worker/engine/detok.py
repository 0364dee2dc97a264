"""Incremental detokenization with stop strings.

Decodes a sliding window of the output ids so each step costs O(window), holds back
incomplete UTF-8 (a trailing U+FFFD) and, when stop strings are set, the last
``max(len(stop)) - 1`` characters, which might be the start of a stop string.
"""

from __future__ import annotations

from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._emitted = 0

    def add(self, token_id: int) -> bool:
        """Add one output token; True when the text now contains a stop string (text cut)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._stop:
                window = self.text[max(0, start - self._hold) :]
                base = max(0, start - self._hold)
                hits = [window.find(s) for s in self._stop]
                hits = [h for h in hits if h >= 0]
                if hits:
                    self.text = self.text[: base + min(hits)]
                    return True
        return False

    def delta(self, final: bool) -> str:
        """Text not yet returned; keeps back a possible stop-string prefix unless ``final``."""
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
