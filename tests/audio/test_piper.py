"""The Piper talker (a real VITS voice) streams a chunk per sentence at the rate asked for,
and Whisper hears back what it said."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_clips import wer

from omniflow.errors import InvalidArgument
from omniflow_services.worker.mm.loading import load_roles
from omniflow_services.worker.mm.media import AUDIO, MediaInput
from omniflow_services.worker.mm.piper_talker import PiperTalker
from omniflow_services.worker.mm.whisper import WhisperEncoder

SENTENCES = (
    "The weather is lovely today. We will walk to the park after lunch. "
    "Bring a warm coat, because the wind is cold."
)


@pytest.fixture(scope="module")
def talker(piper_dir: Path) -> PiperTalker:
    torch.set_num_threads(1)
    return PiperTalker(piper_dir, threads=1)


@pytest.fixture(scope="module")
def whisper(whisper_dir: Path) -> WhisperEncoder:
    return WhisperEncoder(whisper_dir)


def _wav(data: bytes) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(data), "rb") as wf:
        rate = wf.getframerate()
        pcm = np.frombuffer(wf.readframes(wf.getnframes()), "<i2")
    return rate, pcm


@pytest.mark.parametrize(("asked", "rate"), [(0, 16000), (22050, 22050), (24000, 24000)])
def test_chunk_per_sentence_at_the_rate_asked(talker: PiperTalker, asked: int, rate: int) -> None:
    chunks = list(talker.synthesize_sync(SENTENCES, asked))
    assert len(chunks) == 3  # one per sentence, streamed as Piper finishes each
    assert [c.index for c in chunks] == [0, 1, 2]
    assert [c.last for c in chunks] == [False, False, True]
    assert {c.sample_rate for c in chunks} == {rate}
    got_rate, pcm = _wav(chunks[-1].wav)
    joined = b"".join(c.pcm_s16le for c in chunks)
    assert got_rate == rate and pcm.tobytes() == joined
    assert 4.0 < len(pcm) / rate < 15.0  # three spoken sentences
    assert np.abs(pcm).max() > 8000  # speech, not silence


def test_round_trip_whisper_hears_the_voice(talker: PiperTalker, whisper: WhisperEncoder) -> None:
    texts = [
        "Please call Stella and ask her to bring these things with her from the store.",
        "I would like a cup of coffee with milk and sugar.",
        SENTENCES,
    ]
    errors = []
    for text in texts:
        wav = list(talker.synthesize_sync(text, 0))[-1].wav
        errors.append(wer(text, whisper.transcribe(MediaInput(AUDIO, wav, "speech"))))
    assert sum(errors) / len(errors) <= 0.25, errors


@pytest.mark.parametrize(
    ("text", "rate", "message"),
    [
        ("", 0, "text is empty"),
        ("   ", 0, "text is empty"),
        ("x" * 4001, 0, "text has 4001 characters; the talker accepts up to 4000"),
        ("Hello.", 4000, "sample_rate 4000 Hz is out of range; accepted: 0"),
        ("Hello.", 96000, "sample_rate 96000 Hz is out of range"),
    ],
)
async def test_bad_input_fails_before_the_stream(
    talker: PiperTalker, text: str, rate: int, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        async for _ in talker.synthesize(text, None, rate):
            pass


def test_voice_names(talker: PiperTalker) -> None:
    for ok in ("", "default", "en_US-joe-medium"):
        talker.check_voice(ok)
    with pytest.raises(InvalidArgument, match="accepted: default or en_US-joe-medium"):
        talker.check_voice("alice")


async def test_stream_and_loading_by_folder_kind(piper_dir: Path, tmp_path: Path) -> None:
    from omniflow_services.worker.engine import EngineConfig

    roles = await load_roles("talker", str(piper_dir), tmp_path, EngineConfig())
    assert isinstance(roles.talker, PiperTalker)
    chunks = [c async for c in roles.talker.synthesize("One. Two.", None, 0)]
    assert len(chunks) == 2 and chunks[-1].last and chunks[-1].wav
