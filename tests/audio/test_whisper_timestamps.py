"""Whisper's decoding options against CTranslate2's own Whisper runtime on the checkpoint the
folder is converted from: timestamped greedy decoding gives the same token ids (timestamp
tokens included) and the same no-speech probability; a prompt of previous text gives the
same ids; the segments read from those ids are in order and inside the clip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from audio_clips import espeak

from omniflow.errors import InvalidArgument
from omniflow_services.worker.mm.media import AUDIO, MediaInput
from omniflow_services.worker.mm.whisper import WhisperEncoder
from omniflow_services.worker.mm.whisper_decode import (
    TIME_PRECISION,
    TranscribeOptions,
    timestamp_rules,
)

CLIPS = (
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest and was never "
    "seen again.",
    "Please send the quarterly report to the finance team before Friday afternoon. Thank "
    "you very much, see you on Monday.",
)


@pytest.fixture(scope="module")
def ours(whisper_dir: Path) -> WhisperEncoder:
    torch.set_num_threads(1)
    return WhisperEncoder(whisper_dir)


@pytest.fixture(scope="module")
def ct2():
    ctranslate2 = pytest.importorskip("ctranslate2", reason="the reference is CTranslate2")
    from omniflow.models.whisper_ct2 import ct2_source

    model = ctranslate2.models.Whisper(
        str(ct2_source()), device="cpu", compute_type="float32", intra_threads=1
    )
    return ctranslate2, model


def _reference(ct2, feats: torch.Tensor, prompt: list[int]):
    ctranslate2, model = ct2
    view = ctranslate2.StorageView.from_array(feats.numpy())
    return model.generate(view, [prompt], beam_size=1, return_no_speech_prob=True)[0]


@pytest.mark.parametrize("text", CLIPS)
def test_timestamped_ids_equal_ctranslate2(ours: WhisperEncoder, ct2, text: str) -> None:
    inp = ours.preprocess(MediaInput(AUDIO, espeak(text), "clip"))
    prompt = ours.decoder_prompt(TranscribeOptions(timestamps=True))
    assert ours.no_timestamps not in prompt
    ref = _reference(ct2, inp.features[:1], prompt)
    got = ours.model.decode(
        ours.model.encode(inp.features[:1]),
        prompt,
        ours.eos,
        ours.suppress,
        ours.begin_suppress,
        ours.max_new,
        rules=timestamp_rules(ours.timestamp_begin, ours.eos, ours.no_timestamps),
        no_speech=(prompt.index(ours.prompt[0]), ours.no_speech_id),
    )
    assert got.ids == ref.sequences_ids[0]
    assert got.ids[0] >= ours.timestamp_begin  # Whisper's rule: a timestamp first
    assert got.no_speech_prob == pytest.approx(ref.no_speech_prob, abs=1e-4)
    said = ours.transcript(
        MediaInput(AUDIO, espeak(text), "clip"), TranscribeOptions(timestamps=True)
    )
    stamps = [t for t in got.ids if t >= ours.timestamp_begin]
    assert len(said.segments) == len(stamps) // 2
    assert said.segments[0].start == pytest.approx(
        (stamps[0] - ours.timestamp_begin) * TIME_PRECISION
    )
    last = 0.0
    for s in said.segments:
        assert last <= s.start < s.end <= said.audio_seconds + TIME_PRECISION
        last = s.end
    assert " ".join(s.text for s in said.segments) == said.text


def test_prompt_of_previous_text_equals_ctranslate2(ours: WhisperEncoder, ct2) -> None:
    inp = ours.preprocess(MediaInput(AUDIO, espeak(CLIPS[1]), "clip"))
    prompt = ours.decoder_prompt(TranscribeOptions(prompt="Finance team, quarterly report."))
    assert prompt[0] == ours.start_of_prev and prompt[-2:] == ours.prompt
    ref = _reference(ct2, inp.features[:1], prompt)
    states = ours.model.encode(inp.features[:1])
    got = ours.model.decode(
        states, prompt, ours.eos, ours.suppress, ours.begin_suppress, ours.max_new
    )
    assert got.ids == ref.sequences_ids[0]


def test_options_are_checked(ours: WhisperEncoder) -> None:
    with pytest.raises(InvalidArgument, match="English-only"):
        ours.decoder_prompt(TranscribeOptions(language="de"))
    with pytest.raises(InvalidArgument, match="task"):
        ours.decoder_prompt(TranscribeOptions(task="summarise"))
    with pytest.raises(InvalidArgument, match="temperature"):
        ours.decoder_prompt(TranscribeOptions(temperature=1.5))
    # Sampling with a seed is repeatable.
    item = MediaInput(AUDIO, espeak(CLIPS[0]), "clip")
    a = ours.transcript(item, TranscribeOptions(temperature=0.7, seed=3)).text
    assert a == ours.transcript(item, TranscribeOptions(temperature=0.7, seed=3)).text
