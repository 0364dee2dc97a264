"""Whisper's log-mel front end equals transformers' WhisperFeatureExtractor, and audio files
of any common format and rate decode to the same 16 kHz samples."""

from __future__ import annotations

import numpy as np
import pytest
from audio_clips import encode_audio, espeak, tone

from omniflow.errors import InvalidArgument
from omniflow_services.worker.mm.audio_io import decode_audio, resample
from omniflow_services.worker.mm.media import MediaInput
from omniflow_services.worker.mm.whisper_features import N_SAMPLES, log_mel, mel_filters, windows

transformers = pytest.importorskip("transformers", reason="the reference is transformers")


@pytest.fixture(scope="module")
def extractor():
    # Built from its defaults (Whisper's): nothing of ours goes into the reference.
    return transformers.WhisperFeatureExtractor(feature_size=80)


def _reference(extractor, samples: np.ndarray) -> np.ndarray:
    out = extractor(samples, sampling_rate=16000, return_tensors="np")
    return out.input_features[0]


def test_mel_filters_equal_transformers(extractor) -> None:
    np.testing.assert_allclose(mel_filters(80).numpy(), extractor.mel_filters, atol=1e-7)


@pytest.mark.parametrize(
    "clip",
    ["sine-0.3s", "sine-2s", "noise-5s", "noise-29.99s", "noise-30s", "noise-41s", "silence-1s"],
)
def test_features_equal_whisper_feature_extractor(extractor, clip: str) -> None:
    kind, secs = clip.split("-")
    n = int(float(secs.removesuffix("s")) * 16000)
    rng = np.random.default_rng(len(clip))
    samples = {
        "sine": tone(n / 16000),
        "noise": (0.2 * rng.standard_normal(n)).astype(np.float32),
        "silence": np.zeros(n, np.float32),
    }[kind]
    ours = log_mel(samples).numpy()
    ref = _reference(extractor, samples)  # cut to 30 s, padded, as Whisper does
    assert ours.shape == ref.shape == (80, 3000)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_speech_features_and_windows_over_30s(extractor) -> None:
    wav = espeak("Features of a spoken sentence, repeated until it lasts well over thirty seconds.")
    speech = decode_audio(MediaInput("audio", wav, "clip"), 16000, 120.0, 1 << 26)
    long = np.concatenate([speech] * (N_SAMPLES // len(speech) + 2))
    assert len(long) > N_SAMPLES
    np.testing.assert_allclose(log_mel(speech).numpy(), _reference(extractor, speech), atol=1e-5)
    # Past 30 s the extractor truncates; we featurise the rest as windows of their own.
    wins = windows(long)
    assert len(wins) == 2 and len(wins[0]) == N_SAMPLES
    for w in wins:
        np.testing.assert_allclose(log_mel(w).numpy(), _reference(extractor, w), atol=1e-5)


def test_decode_any_format_and_rate_to_16k() -> None:
    rate = 44100
    src = tone(1.0, rate, 300.0)
    want = resample(src, rate, 16000)
    stereo = np.stack([src, src], axis=1)
    for fmt, subtype, data in [
        ("WAV", "PCM_16", src),
        ("WAV", "FLOAT", stereo),
        ("FLAC", "PCM_24", src),
        ("OGG", "VORBIS", src),
    ]:
        got = decode_audio(MediaInput("audio", encode_audio(data, rate, fmt, subtype), "x"),
                           16000, 10.0, 1 << 24)  # fmt: skip
        assert abs(len(got) - 16000) <= 1, fmt
        tol = 0.05 if subtype == "VORBIS" else 1e-3  # lossy codec
        n = min(len(got), len(want))
        assert np.abs(got[:n] - want[:n])[200:-200].max() < tol, fmt


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "clip: the audio is empty"),
        (b"not audio at all" * 10, "clip: not a decodable audio file"),
        (b"RIFF\x10\x00\x00\x00WAVEfmt ", "clip: not a decodable audio file"),
    ],
)
def test_undecodable_audio_names_the_item(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as err:
        decode_audio(MediaInput("audio", data, "clip"), 16000, 10.0, 1 << 20)
    assert "WAV, FLAC" in str(err.value)


def test_limits_are_named() -> None:
    wav = encode_audio(tone(3.0), 16000)
    with pytest.raises(InvalidArgument, match=r"clip: the audio lasts 3.0 s; the limit is 2 s"):
        decode_audio(MediaInput("audio", wav, "clip"), 16000, 2.0, 1 << 20)
    with pytest.raises(InvalidArgument, match=r"clip: the audio is \d+ bytes; the limit is 100"):
        decode_audio(MediaInput("audio", wav, "clip"), 16000, 10.0, 100)
