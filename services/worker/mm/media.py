"""Media decoding and front ends: images (Pillow) and WAV audio (log-mel in plain torch).

Every failure is an ``InvalidArgument`` whose message starts with the item's name (e.g.
``items[1]``), says what was wrong and what is accepted.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from omniflow.errors import InvalidArgument
from omniflow.wav import wav_bytes as wav_bytes  # the talkers import it from here

if TYPE_CHECKING:
    import torch

IMAGE = "image"
AUDIO = "audio"


@dataclass(frozen=True, slots=True)
class MediaInput:
    """One media item as the roles see it: its kind, raw bytes and a name for errors."""

    kind: str  # IMAGE or AUDIO
    data: bytes
    name: str = "item"


def check_bytes(item: MediaInput, kind: str, accepted: str, max_bytes: int) -> None:
    """InvalidArgument, naming the item, when its bytes are empty or over ``max_bytes``."""
    if not item.data:
        raise InvalidArgument(f"{item.name}: the {kind} is empty; send {accepted} bytes")
    if len(item.data) > max_bytes:
        raise InvalidArgument(
            f"{item.name}: the {kind} is {len(item.data)} bytes; the limit is {max_bytes}"
        )


def decode_image(
    item: MediaInput,
    size: int,
    mean: list[float],
    std: list[float],
    max_pixels: int,
    max_bytes: int,
) -> torch.Tensor:
    """Decode, check limits, resize to ``size``², normalise: float32 [3, size, size]."""
    import torch
    from PIL import Image, UnidentifiedImageError

    check_bytes(item, "image", "PNG or JPEG", max_bytes)
    try:
        with Image.open(io.BytesIO(item.data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise InvalidArgument(
                    f"{item.name}: the image is {w}x{h} pixels; the limit is {max_pixels} pixels"
                )
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    except InvalidArgument:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(
            f"{item.name}: not a decodable image ({exc.__class__.__name__}); "
            "send PNG, JPEG, GIF, BMP or WebP bytes"
        ) from None
    arr = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
    m = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return (arr - m) / s


def decode_wav(item: MediaInput, sample_rate: int, max_seconds: float) -> torch.Tensor:
    """Decode 16-bit (or 8/32-bit) PCM WAV at ``sample_rate``: float32 mono samples in [-1, 1]."""
    import torch

    if not item.data:
        raise InvalidArgument(f"{item.name}: the audio is empty; send WAV (PCM) bytes")
    try:
        with wave.open(io.BytesIO(item.data), "rb") as wf:
            rate, channels, width = wf.getframerate(), wf.getnchannels(), wf.getsampwidth()
            frames = wf.getnframes()
            if rate != sample_rate:
                raise InvalidArgument(
                    f"{item.name}: sample rate {rate} Hz is not supported; accepted: "
                    f"{sample_rate} Hz"
                )
            if frames > max_seconds * rate:
                raise InvalidArgument(
                    f"{item.name}: the audio lasts {frames / rate:.1f} s; the limit is "
                    f"{max_seconds:g} s"
                )
            raw = wf.readframes(frames)
    except InvalidArgument:
        raise
    except (wave.Error, EOFError, ValueError) as exc:
        raise InvalidArgument(
            f"{item.name}: not a decodable WAV file ({exc}); send PCM WAV bytes"
        ) from None
    dtypes = {1: np.uint8, 2: np.int16, 4: np.int32}
    if width not in dtypes:
        raise InvalidArgument(f"{item.name}: {8 * width}-bit WAV; accepted: 8, 16, 32-bit PCM")
    pcm = np.frombuffer(raw, dtype=dtypes[width]).astype(np.float32)
    if width == 1:
        pcm = (pcm - 128.0) / 128.0
    else:
        pcm = pcm / float(2 ** (8 * width - 1))
    if channels > 1:
        pcm = pcm.reshape(-1, channels).mean(axis=1)
    if pcm.size == 0:
        raise InvalidArgument(f"{item.name}: the WAV file holds no samples")
    return torch.from_numpy(np.ascontiguousarray(pcm))


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    import torch

    return 2595.0 * torch.log10(1.0 + f / 700.0)


def mel_filterbank(n_fft: int, n_mels: int, sample_rate: int) -> torch.Tensor:
    """Triangular HTK-mel filters [n_mels, n_fft // 2 + 1], area-normalised (Slaney)."""
    import torch

    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    mel_max = _hz_to_mel(torch.tensor(sample_rate / 2.0))
    mels = torch.linspace(0.0, float(mel_max), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    lower, center, upper = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (freqs[None, :] - lower) / (center - lower)
    down = (upper - freqs[None, :]) / (upper - center)
    fb = torch.clamp(torch.minimum(up, down), min=0.0)
    return fb * (2.0 / (upper - lower))


def log_mel(
    samples: torch.Tensor, n_fft: int, hop: int, n_mels: int, sample_rate: int
) -> torch.Tensor:
    """Whisper-style log-mel spectrogram [n_mels, frames] of mono float samples."""
    import torch

    window = torch.hann_window(n_fft)
    if samples.numel() < n_fft // 2 + 1:  # reflect padding needs a few samples
        samples = torch.nn.functional.pad(samples, (0, n_fft // 2 + 1 - samples.numel()))
    spec = torch.stft(samples, n_fft, hop, window=window, center=True, return_complex=True)
    power = spec.abs() ** 2
    mel = mel_filterbank(n_fft, n_mels, sample_rate) @ power
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - 8.0)
    return (logm + 4.0) / 4.0


def to_pcm_s16(wave_f32: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] → 16-bit little-endian PCM bytes."""
    import torch

    x = torch.clamp(wave_f32, -1.0, 1.0) * 32767.0
    return x.round().to(torch.int16).numpy().astype("<i2").tobytes()
