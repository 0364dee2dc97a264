"""Clips spoken by espeak-ng (a reference nobody here wrote) and a word error rate."""

from __future__ import annotations

import io
import re
import shutil
import subprocess

import numpy as np
import pytest


def espeak(text: str, speed: int = 175) -> bytes:
    """``text`` spoken by espeak-ng (words per minute: its default): a WAV file (22,050 Hz,
    16-bit mono)."""
    binary = shutil.which("espeak-ng")
    if binary is None:
        pytest.skip("needs espeak-ng (apt-get install espeak-ng) to speak the test clips")
    out = subprocess.run(
        [binary, "--stdout", "-s", str(speed), text], capture_output=True, check=True, timeout=60
    )
    return out.stdout


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level edit distance over the reference's length."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            cur = min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
            prev, row[j] = row[j], cur
    return row[len(hyp)] / max(1, len(ref))


def tone(seconds: float, rate: int = 16000, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def encode_audio(
    samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str = "PCM_16"
) -> bytes:
    """``samples`` ([n] or [n, channels]) as an audio file of ``fmt`` (libsndfile)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()
