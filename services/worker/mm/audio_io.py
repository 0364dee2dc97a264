"""Audio in and out at any rate: decode a common audio file (libsndfile through
``soundfile``: WAV, FLAC, OGG/Vorbis, MP3, AIFF, ...) to mono float32 and resample
(``soxr``); turn float samples into 16-bit PCM at the rate a caller asks for.

Every decode failure is an ``InvalidArgument`` that starts with the item's name, says what
was wrong and what is accepted.
"""

from __future__ import annotations

import io

import numpy as np

from omniflow.errors import InvalidArgument
from omniflow_services.worker.mm.media import MediaInput, check_bytes

# What any rate argument may be; outside it resampling is more likely a mistake than a wish.
MIN_RATE, MAX_RATE = 8000, 48000
FORMATS = "WAV, FLAC, OGG/Vorbis, MP3, AIFF or any libsndfile format"


def decode_audio(
    item: MediaInput, sample_rate: int, max_seconds: float, max_bytes: int
) -> np.ndarray:
    """Decode ``item`` and resample to ``sample_rate``: float32 mono samples in [-1, 1]."""
    import soundfile as sf

    check_bytes(item, "audio", FORMATS, max_bytes)
    try:
        with sf.SoundFile(io.BytesIO(item.data)) as f:
            rate, frames = int(f.samplerate), int(f.frames)
            # The header's length is checked before any sample is decoded.
            if rate > 0 and frames > max_seconds * rate:
                raise InvalidArgument(
                    f"{item.name}: the audio lasts {frames / rate:.1f} s; the limit is "
                    f"{max_seconds:g} s"
                )
            pcm = f.read(dtype="float32", always_2d=True)
    except InvalidArgument:
        raise
    except (sf.SoundFileError, RuntimeError, TypeError, ValueError, EOFError) as exc:
        raise InvalidArgument(
            f"{item.name}: not a decodable audio file ({str(exc).strip() or type(exc).__name__});"
            f" send {FORMATS} bytes"
        ) from None
    if pcm.shape[0] == 0:
        raise InvalidArgument(f"{item.name}: the audio file holds no samples")
    if pcm.shape[0] > max_seconds * rate:  # headers that do not know their length
        raise InvalidArgument(
            f"{item.name}: the audio lasts {pcm.shape[0] / rate:.1f} s; the limit is "
            f"{max_seconds:g} s"
        )
    mono = pcm.mean(axis=1) if pcm.shape[1] > 1 else pcm[:, 0]
    return resample(np.ascontiguousarray(mono, dtype=np.float32), rate, sample_rate)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """float32 samples from one rate to another (soxr, high quality); a copy-free no-op
    when the rates are equal."""
    if from_rate == to_rate:
        return samples
    import soxr

    return soxr.resample(samples, from_rate, to_rate, quality="HQ").astype(np.float32, copy=False)


def check_rate(requested: int, default: int, name: str = "sample_rate") -> int:
    """The output rate for a request: ``default`` for 0, else ``requested`` within limits."""
    if requested == 0:
        return default
    if not MIN_RATE <= requested <= MAX_RATE:
        raise InvalidArgument(
            f"{name} {requested} Hz is out of range; accepted: 0 (= {default} Hz) or "
            f"{MIN_RATE} to {MAX_RATE} Hz"
        )
    return requested


class StreamResampler:
    """Resample consecutive chunks of one utterance as one signal (no seams at chunk
    boundaries), ``from_rate`` → ``to_rate``; a pass-through when they are equal."""

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self.from_rate, self.to_rate = from_rate, to_rate
        self._stream = None
        if from_rate != to_rate:
            import soxr

            self._stream = soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32")

    def __call__(self, chunk: np.ndarray, last: bool = False) -> np.ndarray:
        x = np.ascontiguousarray(chunk, dtype=np.float32)
        if self._stream is None:
            return x
        return self._stream.resample_chunk(x, last=last)


def pcm_s16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] → 16-bit little-endian PCM bytes."""
    x = np.clip(samples, -1.0, 1.0) * 32767.0
    return np.round(x).astype("<i2").tobytes()
