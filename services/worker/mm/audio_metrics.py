"""Prometheus series of the audio paths: transcribe (encoder role) and Synthesize (talker
role). First-audio latency is what a spoken reply waits for; audio seconds over wall time is
the real-time factor (``rate(..._audio_seconds_total) / rate(..._seconds_sum)``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

from prometheus_client import Counter, Histogram

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
            15.0, 20.0, 30.0, 60.0, 120.0)  # fmt: skip

TRANSCRIBE = Histogram(
    "omniflow_worker_transcribe_seconds",
    "Time of one transcribe call (decode, features, Whisper encoder and greedy decoder)",
    buckets=_BUCKETS,
)
TRANSCRIBED = Counter(
    "omniflow_worker_transcribed_audio_seconds_total", "Seconds of audio transcribed"
)
FIRST_AUDIO = Histogram(
    "omniflow_worker_synthesize_first_chunk_seconds",
    "Time from a Synthesize call to its first audio chunk",
    buckets=_BUCKETS,
)
SYNTHESIZE = Histogram(
    "omniflow_worker_synthesize_seconds",
    "Time from a Synthesize call to its last audio chunk",
    buckets=_BUCKETS,
)
SYNTHESIZED = Counter(
    "omniflow_worker_synthesized_audio_seconds_total", "Seconds of audio synthesised"
)


class _Chunk(Protocol):
    pcm_s16le: bytes
    sample_rate: int


C = TypeVar("C", bound=_Chunk)


def record_transcribe(started: float, audio_seconds: float) -> None:
    TRANSCRIBE.observe(time.perf_counter() - started)
    TRANSCRIBED.inc(audio_seconds)


async def timed_chunks(chunks: AsyncIterator[C]) -> AsyncIterator[C]:
    """``chunks`` as they come, timing the first and the last and counting audio seconds."""
    start = time.perf_counter()
    first = True
    async for ch in chunks:
        if first:
            FIRST_AUDIO.observe(time.perf_counter() - start)
            first = False
        if ch.sample_rate:
            SYNTHESIZED.inc(len(ch.pcm_s16le) / 2 / ch.sample_rate)
        yield ch
    SYNTHESIZE.observe(time.perf_counter() - start)
