"""What Whisper's decoder is asked for beyond plain greedy text: a prompt of previous text,
the task and language tokens, sampling at a temperature, and timestamps.

Timestamps follow Whisper's own rules (the paper's and its reference decoder's): the first
token is a timestamp no later than 1 s, timestamps come in pairs (a segment's end, then the
next one's start) except right before the end of text, never go back in time, and a
timestamp is forced when the timestamp tokens together are likelier than any single text
token. ``<|t|>`` is ``t * 0.02`` s from the window's start.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omniflow.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

TIME_PRECISION = 0.02  # seconds per timestamp token
MAX_INITIAL_TIMESTAMP = 1.0  # the first timestamp is at most this far into the window

Rules = Callable[[list[int], "torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TranscribeOptions:
    """OpenAI's transcription fields, as the decoder takes them."""

    prompt: str = ""
    temperature: float = 0.0
    language: str = ""  # "" : the model's own (English for an English-only model)
    task: str = "transcribe"  # or "translate" (into English)
    timestamps: bool = False  # segments with start/end (verbose_json, srt, vtt)
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """One timed stretch of speech, in OpenAI's verbose_json terms."""

    id: int
    seek: int  # the window's start, in 10 ms frames (as Whisper counts)
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


def timestamp_rules(timestamp_begin: int, eot: int, no_timestamps: int) -> Rules:
    """The logit rules of timestamped decoding, over the ids generated so far."""
    max_initial = round(MAX_INITIAL_TIMESTAMP / TIME_PRECISION)

    def apply(seq: list[int], logits: torch.Tensor) -> torch.Tensor:
        import torch

        logits = logits.clone()
        logits[no_timestamps] = float("-inf")
        n = len(seq)
        last_ts = n >= 1 and seq[-1] >= timestamp_begin
        penultimate_ts = n < 2 or seq[-2] >= timestamp_begin
        if last_ts:
            if penultimate_ts:  # a pair just closed: text (or eot) next
                logits[timestamp_begin:] = float("-inf")
            else:  # a segment's end: its pair's start, or eot
                logits[:eot] = float("-inf")
        stamps = [t for t in seq if t >= timestamp_begin]
        if stamps:  # never back in time; a new segment starts after the last end
            floor = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
            logits[timestamp_begin:floor] = float("-inf")
        if n == 0:
            logits[:timestamp_begin] = float("-inf")
            logits[timestamp_begin + max_initial + 1 :] = float("-inf")
        lp = torch.log_softmax(logits.float(), -1)
        if lp[timestamp_begin:].logsumexp(-1) > lp[:timestamp_begin].max():
            logits[:timestamp_begin] = float("-inf")
        return logits

    return apply


def compression_ratio(text: str) -> float:
    raw = text.encode()
    return len(raw) / max(1, len(zlib.compress(raw)))


def segments_of(
    ids: list[int],
    logprobs: list[float],
    timestamp_begin: int,
    decode: Callable[[list[int]], str],
    window: int,
    window_seconds: float,
    temperature: float,
    no_speech_prob: float,
    first_id: int = 0,
) -> list[Segment]:
    """The segments of one window's timestamped ids (window ``window``, of
    ``window_seconds`` of real audio); text after the last timestamp ends at the window's
    end."""
    offset = window * 30.0
    out: list[Segment] = []
    start: float | None = None
    text: list[int] = []
    lps: list[float] = []

    def close(end: float) -> None:
        words = decode(text).strip()
        if words and start is not None:
            out.append(
                Segment(
                    first_id + len(out),
                    int(offset * 100),
                    round(offset + start, 2),
                    round(offset + max(end, start), 2),
                    words,
                    tuple(text),
                    temperature,
                    sum(lps) / max(1, len(lps)),
                    compression_ratio(words),
                    no_speech_prob,
                )
            )

    for tok, lp in zip(ids, logprobs, strict=True):
        if tok >= timestamp_begin:
            t = (tok - timestamp_begin) * TIME_PRECISION
            if start is None:
                start = t
            elif text:
                close(t)
                start, text, lps = None, [], []
            else:
                start = t  # two in a row: the second starts the next segment
        else:
            if start is None:
                start = 0.0
            text.append(tok)
            lps.append(lp)
    if text:
        close(window_seconds)
    return out


def special_id(token_to_id: Callable[[str], int | None], name: str) -> int:
    tid = token_to_id(name)
    if tid is None:
        raise InvalidArgument(f"this Whisper tokenizer has no {name} token")
    return tid


def check_options(opts: TranscribeOptions) -> None:
    if opts.task not in ("transcribe", "translate"):
        raise InvalidArgument(f"task {opts.task!r}; accepted: transcribe, translate")
    if not (0.0 <= opts.temperature <= 1.0) or math.isnan(opts.temperature):
        raise InvalidArgument(f"temperature {opts.temperature}: accepted 0 to 1")
