"""Whisper tiny.en converted from CTranslate2: the converted weights against CTranslate2's own
runtime, our encoder/decoder against transformers' on the converted folder, and real speech
(espeak-ng) transcribed."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_clips import encode_audio, espeak, tone, wer

from omniflow.errors import FailedPrecondition, InvalidArgument
from omniflow.models.whisper_ct2 import ct2_source, read_ct2
from omniflow_services.worker.mm.encoders import EncoderRole, load_encoder
from omniflow_services.worker.mm.media import AUDIO, MediaInput
from omniflow_services.worker.mm.whisper import WhisperEncoder

transformers = pytest.importorskip("transformers", reason="the reference is transformers")

SENTENCES = [
    "Please call Stella and ask her to bring these things with her from the store.",
    "Open the door and turn on the light.",
    "My name is John and I live in a small house.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ours(whisper_dir: Path) -> WhisperEncoder:
    enc = load_encoder(whisper_dir)
    assert isinstance(enc, WhisperEncoder)  # chosen by model_type "whisper"
    return enc


@pytest.fixture(scope="module")
def hf(whisper_dir: Path):
    model = transformers.WhisperForConditionalGeneration.from_pretrained(
        whisper_dir, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def ct2():
    ctranslate2 = pytest.importorskip("ctranslate2", reason="the reference is CTranslate2")
    return ctranslate2, ctranslate2.models.Whisper(
        str(ct2_source()), device="cpu", compute_type="float32", intra_threads=1
    )


@pytest.fixture(scope="module")
def speech(ours: WhisperEncoder):
    return ours.preprocess(MediaInput(AUDIO, espeak(SENTENCES[0]), "clip"))


def test_reader_and_split(whisper_dir: Path) -> None:
    from safetensors.numpy import load_file

    ct = read_ct2(ct2_source() / "model.bin")
    assert ct.spec == "WhisperSpec" and ct.scalar("encoder/num_heads") == 6
    hf_w = load_file(str(whisper_dir / "model.safetensors"))
    fused = ct.take("encoder/layer_2/self_attention/linear_0/weight")
    q, k, v = (hf_w[f"model.encoder.layers.2.self_attn.{n}_proj.weight"] for n in "qkv")
    np.testing.assert_array_equal(np.concatenate([q, k, v]), fused)
    kv = ct.take("decoder/layer_3/attention/linear_1/weight")
    k, v = (hf_w[f"model.decoder.layers.3.encoder_attn.{n}_proj.weight"] for n in "kv")
    np.testing.assert_array_equal(np.concatenate([k, v]), kv)
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in hf_w  # Whisper has none


def test_encoder_equals_transformers(ours: WhisperEncoder, hf, speech) -> None:
    with torch.no_grad():
        ref = hf.model.encoder(speech.features).last_hidden_state
    got = ours.model.encode(speech.features)
    assert got.shape == ref.shape == (1, 1500, 384)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_converted_weights_match_ctranslate2(ours: WhisperEncoder, ct2, speech) -> None:
    ctranslate2, model = ct2
    feats = speech.features.numpy()
    ref = np.array(model.encode(ctranslate2.StorageView.from_array(feats), to_cpu=True))
    got = ours.model.encode(speech.features).numpy()
    # Same float16 weights, float32 compute on both sides: kernels differ, not weights.
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)
    out = model.generate(ctranslate2.StorageView.from_array(feats), [ours.prompt], beam_size=1)
    assert ours.transcribe_ids(speech)[0] == out[0].sequences_ids[0]


def test_greedy_equals_transformers_generate(ours: WhisperEncoder, hf, speech) -> None:
    with torch.no_grad():
        ref = hf.generate(speech.features, do_sample=False, num_beams=1)[0].tolist()
    got = ours.transcribe_ids(speech)[0]
    # transformers returns the new tokens, with or without the prompt and eos by version.
    assert len(got) > 5
    assert got == [t for t in ref if t not in (ours.eos, *ours.prompt)]


def test_transcribe_espeak_speech(ours: WhisperEncoder) -> None:
    errors = []
    for s in SENTENCES:
        text = ours.transcribe(MediaInput(AUDIO, espeak(s), "clip"))
        errors.append(wer(s, text))
    assert sum(errors) / len(errors) <= 0.25, errors


def test_transcribe_over_30s_in_windows(ours: WhisperEncoder) -> None:
    import soundfile as sf

    from omniflow_services.worker.mm.audio_io import decode_audio

    one = decode_audio(MediaInput(AUDIO, espeak(SENTENCES[0]), "a"), 16000, 60, 1 << 26)
    gap = np.zeros(30 * 16000 - len(one), np.float32)  # the second sentence starts at 30 s
    two = decode_audio(MediaInput(AUDIO, espeak(SENTENCES[1]), "b"), 16000, 60, 1 << 26)
    clip = encode_audio(np.concatenate([one, gap, two]), 16000, "FLAC")
    assert sf.info(io.BytesIO(clip)).duration > 30
    text = ours.transcribe(MediaInput(AUDIO, clip, "clip"))
    assert wer(" ".join(SENTENCES[:2]), text) <= 0.25, text


def test_encode_embeddings_per_25_hz(ours: WhisperEncoder) -> None:
    inp = ours.preprocess(MediaInput(AUDIO, encode_audio(tone(2.0), 16000), "clip"))
    emb = ours.encode(inp)
    assert emb.shape == (50, ours.out_hidden)  # 2 s: 100 states, pooled by two
    assert torch.isfinite(emb).all()


def test_role_encodes_whisper_audio_once(ours: WhisperEncoder) -> None:
    role = EncoderRole([ours])
    item = MediaInput(AUDIO, encode_audio(tone(1.0), 16000), "items[0]")
    first, again = role.encode_sync([item]), role.encode_sync([item])
    assert first[0].embeddings.shape == (25, ours.out_hidden) and not first[0].cached
    assert again[0].cached and torch.equal(again[0].embeddings, first[0].embeddings)


async def test_role_transcribes_and_says_what_is_wrong(ours: WhisperEncoder) -> None:
    role = EncoderRole([ours])
    assert role.operations == ("transcribe",)
    said = await role.transcribe(MediaInput(AUDIO, espeak("Good morning."), "inputs.audio"))
    assert wer("good morning", said.text) <= 0.5, said
    assert 0.5 < said.audio_seconds < 3.0
    with pytest.raises(InvalidArgument, match=r"inputs\.audio: not a decodable audio file"):
        await role.transcribe(MediaInput(AUDIO, b"\x00garbage" * 50, "inputs.audio"))


def test_any_transformers_whisper_folder_loads(hf, tmp_path: Path) -> None:
    """A folder transformers wrote (no projector) loads with the same code and transcribes."""
    hf.save_pretrained(tmp_path / "saved")  # weights, config.json, generation_config.json
    tokenizer = transformers.WhisperTokenizerFast.from_pretrained(ct2_source())
    tokenizer.save_pretrained(tmp_path / "saved")  # tokenizer.json, as a processor writes it
    enc = load_encoder(tmp_path / "saved")
    assert isinstance(enc, WhisperEncoder) and enc.out_hidden is None
    role = EncoderRole([enc])
    assert role.operations == ("transcribe",)
    text = enc.transcribe(MediaInput(AUDIO, espeak(SENTENCES[1]), "clip"))
    assert wer(SENTENCES[1], text) <= 0.25, text
    with pytest.raises(FailedPrecondition, match="can transcribe but not encode"):
        role.encode_sync([MediaInput(AUDIO, espeak("Hello."), "items[0]")])


def test_transcribe_needs_whisper(tmp_path: Path) -> None:
    from omniflow.models.resolve import resolve_model

    tiny = load_encoder(resolve_model("tiny:audio-encoder", tmp_path))
    role = EncoderRole([tiny])
    assert role.operations == ()
    with pytest.raises(FailedPrecondition, match="transcribe needs a Whisper audio encoder"):
        asyncio.run(role.transcribe(MediaInput(AUDIO, b"x", "inputs.audio")))
