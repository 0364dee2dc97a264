"""Audio the gateway answers with: WAV or raw PCM in OpenAI's formats, and voice names.

Talkers speak 16-bit mono PCM at a rate of their own (16 kHz when the request names none,
the worker API's contract). OpenAI's ``pcm16`` is raw 16-bit mono little-endian at 24 kHz
with no header, so PCM is resampled to that rate (one soxr stream per utterance: no seams
between chunks); ``wav`` keeps the talker's rate, which its header names.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Callable

import numpy as np

from omniflow.errors import InvalidArgument
from omniflow.wav import wav_bytes

#: OpenAI's rate for raw ``pcm16`` (chat audio output) and ``pcm`` (audio/speech).
PCM16_RATE = 24000
#: What a talker answers a request that names no rate with (the worker API's contract).
TALKER_DEFAULT_RATE = 16000
#: Chat audio output formats served; ``pcm16`` is the only one that streams (as OpenAI's).
CHAT_FORMATS = ("wav", "pcm16")
#: OpenAI's built-in voice names. A talker serves one voice: each of these names it.
OPENAI_VOICES = frozenset(
    {
        "alloy",
        "ash",
        "ballad",
        "cedar",
        "coral",
        "echo",
        "fable",
        "marin",
        "nova",
        "onyx",
        "sage",
        "shimmer",
        "verse",
    }
)


def talker_voice(voice: str) -> str:
    """The voice to ask a talker for: OpenAI's names (and "") are its own one voice ("")."""
    return "" if voice.lower() in OPENAI_VOICES else voice


def check_chat_voice(voice: str, param: str = "audio.voice") -> None:
    """A workflow's talker node names its own voice; a request may only name OpenAI's
    voices or "default" (all of them are the talker's one voice)."""
    if voice.lower() not in OPENAI_VOICES and voice not in ("", "default"):
        raise InvalidArgument(
            f"{param} {voice!r} is not served; accepted: {', '.join(sorted(OPENAI_VOICES))} "
            "or 'default' (every name is spoken by the workflow's one talker voice)"
        )


def is_wav(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WAVE"


def pcm_of(audio: bytes, rate: int) -> tuple[bytes, int]:
    """(16-bit mono PCM, its rate) of ``audio``: a WAV file (its header names the rate) or
    raw PCM at ``rate``."""
    if not is_wav(audio):
        return audio[: len(audio) // 2 * 2], rate
    try:
        with wave.open(io.BytesIO(audio)) as w:
            if w.getsampwidth() != 2 or w.getnchannels() != 1:
                raise InvalidArgument(
                    f"the workflow's audio is {w.getnchannels()}-channel "
                    f"{8 * w.getsampwidth()}-bit WAV; accepted: 16-bit mono"
                )
            return w.readframes(w.getnframes()), w.getframerate()
    except (wave.Error, EOFError) as exc:
        raise InvalidArgument(f"the workflow's audio is not a readable WAV file: {exc}") from None


class PcmResampler:
    """16-bit mono PCM chunks of one utterance, ``from_rate`` → ``to_rate``.

    Chunks may split a sample: an odd trailing byte waits for the next chunk.
    """

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self._carry = b""
        self._resample: Callable[[np.ndarray, bool], np.ndarray] | None = None
        if from_rate != to_rate:
            import soxr  # the gateway extra ships it

            stream = soxr.ResampleStream(from_rate, to_rate, 1, dtype="int16")
            self._resample = lambda x, last: stream.resample_chunk(x, last=last)

    def __call__(self, chunk: bytes, last: bool = False) -> bytes:
        data = self._carry + chunk
        cut = len(data) // 2 * 2
        data, self._carry = data[:cut], data[cut:]
        if self._resample is None:
            return data
        x = np.frombuffer(data, dtype="<i2")
        return np.ascontiguousarray(self._resample(x, last), dtype="<i2").tobytes()


def encode(audio: bytes, rate: int, fmt: str) -> bytes:
    """``audio`` (WAV, or raw PCM at ``rate``) in OpenAI format ``fmt`` (wav, pcm16/pcm)."""
    pcm, rate = pcm_of(audio, rate)
    if fmt == "wav":
        return audio if is_wav(audio) else wav_bytes(pcm, rate)
    return PcmResampler(rate, PCM16_RATE)(pcm, last=True)
