"""What a streaming edge hands its consumer: phrases cut from a text stream, and the join
of the per-chunk calls' outputs. No gRPC, no asyncio: the executor drives these.

Phrases (an edge with ``phrase_chars`` > 0): a talker that speaks every token on its own
makes one call per token and sounds like it; one that waits for the whole answer starts
late. A phrase ends after a sentence mark (``. ! ?`` or a line break) followed by
whitespace, or after a clause mark (``, ; :``) once the phrase has ``MIN_CLAUSE_CHARS``;
a phrase with no mark is cut at ``phrase_chars`` (at its last space when it has one).

The first phrase is short, as streaming TTS systems do it: what the listener waits for is
the first audio, so the first phrase also ends at its first clause mark, whatever its
length, or at the first word boundary once it has ``FIRST_PHRASE_CHARS`` (a few words,
about four tokens; Piper speaks that in a fifth of a second). Later phrases are whole
sentences or long clauses, which sound better; the talker is busy with the first while the
llm writes them.
"""

from __future__ import annotations

import io
import re
import wave
from typing import Any

MIN_CLAUSE_CHARS = 24
_SENTENCE = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+")
_CLAUSE = re.compile(r"[,;:]\s+")
FIRST_PHRASE_CHARS = 12
_SPACE = re.compile(r"\s+")


class Phrases:
    """Cuts whole phrases off the front of a growing text."""

    def __init__(self, max_chars: int, first_chars: int = FIRST_PHRASE_CHARS) -> None:
        self.max_chars = max(1, max_chars)
        self.first_chars = max(1, first_chars)
        self.pending = ""
        self.started = False  # a phrase with words in it has been handed out

    def feed(self, text: str) -> str:
        """Add ``text``; returns the longest front part that ends on a phrase boundary
        (every complete phrase so far, joined), or "" while the first is incomplete."""
        self.pending += text
        cut = 0 if self.started else self._first_cut()
        for m in _SENTENCE.finditer(self.pending, cut):
            if self.pending[: m.end()].strip():
                cut = m.end()
        for m in _CLAUSE.finditer(self.pending, cut):
            if m.start() - cut >= MIN_CLAUSE_CHARS:
                cut = m.end()
        while len(self.pending) - cut > self.max_chars:  # a long stretch with no mark
            end = cut + self.max_chars
            space = self.pending.rfind(" ", cut + 1, end)
            cut = space + 1 if space > cut else end
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.started = self.started or bool(out.strip())
        return out

    def _first_cut(self) -> int:
        """Where the first phrase ends, if it has: its first sentence or clause mark, or
        its first word boundary past ``first_chars`` (0: not yet)."""
        ends = [
            m.end()
            for rule in (_SENTENCE, _CLAUSE)
            for m in rule.finditer(self.pending)
            if self.pending[: m.start()].strip()
        ]
        for m in _SPACE.finditer(self.pending):
            if m.end() > self.max_chars:
                break  # too long for a phrase: the max_chars rule cuts it
            if len(self.pending[: m.start()].strip()) >= self.first_chars:
                ends.append(m.end())
                break
        return min(ends, default=0)

    def rest(self) -> str:
        """What is left once the stream has ended."""
        out, self.pending = self.pending, ""
        return out


def _is_wav(value: Any) -> bool:
    return isinstance(value, bytes) and value[:4] == b"RIFF" and value[8:12] == b"WAVE"


def join_wavs(files: list[bytes]) -> bytes:
    """One WAV file with the audio of ``files`` in order (all of one format)."""
    frames: list[bytes] = []
    params = None
    for data in files:
        with wave.open(io.BytesIO(data), "rb") as w:
            fmt = (w.getnchannels(), w.getsampwidth(), w.getframerate())
            if params is not None and fmt != params:
                raise ValueError(f"WAV parts differ in format: {params} and {fmt}")
            params = fmt
            frames.append(w.readframes(w.getnframes()))
    assert params is not None
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(params[0])
        out.setsampwidth(params[1])
        out.setframerate(params[2])
        out.writeframes(b"".join(frames))
    return buf.getvalue()


def join(values: list[Any], spaced: bool = False) -> Any:
    """The outputs of a streaming consumer's calls as one: text and bytes concatenated (WAV
    files as one WAV), lists extended, other values the last one. ``spaced``: the texts are
    whole answers (one per phrase), so two that meet with no whitespace get a space."""
    if values and all(isinstance(v, str) for v in values):
        if not spaced:
            return "".join(values)
        out = ""
        for v in values:
            gap = out and v and not out[-1].isspace() and not v[0].isspace()
            out += (" " if gap else "") + v
        return out
    if len(values) > 1 and all(_is_wav(v) for v in values):
        try:
            return join_wavs(values)
        except (wave.Error, EOFError, ValueError):
            pass  # not WAVs of one format after all: plain bytes
    if values and all(isinstance(v, bytes) for v in values):
        return b"".join(values)
    if values and all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    return values[-1] if values else None
