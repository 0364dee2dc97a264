"""WAV containers for the mono 16-bit PCM the talkers produce (worker, gateway alike)."""

from __future__ import annotations

import io
import wave


def wav_bytes(pcm_s16: bytes, sample_rate: int) -> bytes:
    """A mono 16-bit WAV file around raw little-endian samples."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(2)
        wf.setframerate(sample_rate)
        wf.writeframes(pcm_s16)
    return buf.getvalue()
