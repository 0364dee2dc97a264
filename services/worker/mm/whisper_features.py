"""Whisper's log-mel front end, by the definition of ``WhisperFeatureExtractor``.

16 kHz mono samples, cut or zero-padded to 30 s (480,000 samples); a centred STFT (reflect
padding) with a periodic Hann window of 400 samples and a hop of 160, the last frame
dropped: 3,000 frames, 100 per second; power spectrum; ``num_mel_bins`` triangular filters
on the Slaney mel scale (linear below 1 kHz, logarithmic above) from 0 to 8 kHz, Slaney
area normalisation; ``log10`` of the energies clamped at 1e-10; values more than 8 below
the maximum raised to it; then ``(x + 4) / 4``.

Audio longer than 30 s is cut into consecutive 30 s windows (``windows``), each padded and
featurised like a clip of its own.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE
N_FRAMES = N_SAMPLES // HOP

_F_SP = 200.0 / 3.0  # Hz per mel below 1 kHz
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = math.log(6.4) / 27.0


def hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale."""
    f = np.asarray(f, dtype=np.float64)
    lin = f / _F_SP
    log = _MIN_LOG_MEL + np.log(np.maximum(f, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return np.where(f >= _MIN_LOG_HZ, log, lin)


def mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    lin = m * _F_SP
    log = _MIN_LOG_HZ * np.exp(_LOG_STEP * (np.maximum(m, _MIN_LOG_MEL) - _MIN_LOG_MEL))
    return np.where(m >= _MIN_LOG_MEL, log, lin)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Slaney-normalised triangular filters [n_freqs, n_mels] (float32)."""
    n_freqs = n_fft // 2 + 1
    fft_freqs = np.linspace(0.0, sample_rate / 2, n_freqs)
    mels = np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2)
    edges = mel_to_hz(mels)
    width = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    fb = np.maximum(0.0, np.minimum(down, up))
    fb *= 2.0 / (edges[2 : n_mels + 2] - edges[:n_mels])
    return torch.from_numpy(fb).to(torch.float32)


def log_mel(samples: np.ndarray | torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """One 30 s window: 16 kHz float samples → float32 [n_mels, 3000]."""
    x = torch.as_tensor(np.asarray(samples, dtype=np.float32)).reshape(-1)[:N_SAMPLES]
    if x.numel() < N_SAMPLES:
        x = torch.nn.functional.pad(x, (0, N_SAMPLES - x.numel()))
    window = torch.hann_window(N_FFT)
    spec = torch.stft(x, N_FFT, HOP, window=window, return_complex=True)
    power = (spec[..., :-1].abs() ** 2).contiguous()
    mel = mel_filters(n_mels).T @ power
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - 8.0)
    return (logm + 4.0) / 4.0


def windows(samples: np.ndarray) -> list[np.ndarray]:
    """Consecutive 30 s windows of ``samples`` (the last one shorter); one for empty input."""
    n = max(1, math.ceil(len(samples) / N_SAMPLES))
    return [samples[i * N_SAMPLES : (i + 1) * N_SAMPLES] for i in range(n)]


def valid_states(num_samples: int, max_states: int) -> int:
    """Encoder states (one per two mel frames: 20 ms) that cover real audio."""
    frames = min(N_FRAMES, math.ceil(num_samples / HOP))  # Whisper keeps 3000 of 3001
    return min(max_states, math.ceil(frames / 2))
