"""/v1/audio/transcriptions and /translations through the official ``openai`` client: the
word error rate on clips espeak-ng speaks is at most faster-whisper's own (the same
CTranslate2 Whisper tiny.en the model folder is converted from) plus 5 points, and every
``response_format`` has OpenAI's shape."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import httpx
import pytest
from endpoints_topology import WHISPER, Endpoints

sys.path.insert(0, str(Path(__file__).parent.parent / "audio"))
from audio_clips import espeak, wer

CLIPS = (
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest and was "
    "never seen again.",
    "Please send the quarterly report to the finance team before Friday afternoon.",
)
CUE = re.compile(r"^(\d\d:\d\d:\d\d[,.]\d{3}) --> (\d\d:\d\d:\d\d[,.]\d{3})$")


@pytest.fixture(scope="module")
def clips() -> list[tuple[str, bytes]]:
    return [(text, espeak(text)) for text in CLIPS]


@pytest.fixture(scope="module")
def faster_whisper_texts(clips: list[tuple[str, bytes]]) -> list[str]:
    fw = pytest.importorskip("faster_whisper", reason="the reference is faster-whisper")
    from omniflow.models.whisper_ct2 import ct2_source

    model = fw.WhisperModel(str(ct2_source()), device="cpu", compute_type="float32", cpu_threads=1)
    out = []
    for _, wav in clips:
        segments, _info = model.transcribe(io.BytesIO(wav), language="en")
        out.append(" ".join(s.text.strip() for s in segments))
    return out


def _seconds(clock: str) -> float:
    h, m, s = clock.replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def test_wer_within_five_points_of_faster_whisper(client, clips, faster_whisper_texts) -> None:
    for (ref, wav), theirs in zip(clips, faster_whisper_texts, strict=True):
        got = client.audio.transcriptions.create(file=("clip.wav", wav), model=WHISPER)
        ours_wer, their_wer = wer(ref, got.text), wer(ref, theirs)
        print(f"WER ours {ours_wer:.3f} faster-whisper {their_wer:.3f}: {got.text!r}")
        assert ours_wer <= their_wer + 0.05 + 1e-9, (got.text, theirs)  # 1e-9: float sums


def test_response_formats(client, clips) -> None:
    _, wav = clips[0]
    plain = client.audio.transcriptions.create(file=("a.wav", wav), model=WHISPER)
    assert plain.text and plain.usage.type == "duration" and plain.usage.seconds >= 1
    text = client.audio.transcriptions.create(
        file=("a.wav", wav), model=WHISPER, response_format="text"
    )
    assert isinstance(text, str) and text.strip() == plain.text
    verbose = client.audio.transcriptions.create(
        file=("a.wav", wav),
        model=WHISPER,
        response_format="verbose_json",
        timestamp_granularities=["segment"],
    )
    assert verbose.language == "english" and verbose.duration > 1
    segs = verbose.segments
    assert segs and " ".join(s.text for s in segs).split() == verbose.text.split()
    last = 0.0
    for s in segs:  # in order, inside the clip, each with its tokens
        assert last <= s.start <= s.end <= verbose.duration + 0.02 and s.tokens
        assert s.avg_logprob <= 0 and 0 <= s.no_speech_prob <= 1
        last = s.end
    srt = client.audio.transcriptions.create(
        file=("a.wav", wav), model=WHISPER, response_format="srt"
    )
    lines = srt.strip().splitlines()
    assert lines[0] == "1" and CUE.match(lines[1]) and "," in lines[1]
    start, end = CUE.match(lines[1]).groups()
    assert _seconds(start) == pytest.approx(segs[0].start, abs=1e-3)
    assert _seconds(end) == pytest.approx(segs[0].end, abs=1e-3)
    vtt = client.audio.transcriptions.create(
        file=("a.wav", wav), model=WHISPER, response_format="vtt"
    )
    vlines = vtt.strip().splitlines()
    assert vlines[0] == "WEBVTT" and CUE.match(vlines[2]) and "." in vlines[2]
    assert vlines[3] == segs[0].text.strip()


def test_translation_fields_and_alias(client, clips) -> None:
    ref, wav = clips[1]
    said = client.audio.translations.create(file=("b.wav", wav), model=WHISPER)
    heard = client.audio.transcriptions.create(file=("b.wav", wav), model="whisper-1")
    assert said.text == heard.text and wer(ref, said.text) < 0.5  # English only: the same
    verbose = client.audio.translations.create(
        file=("b.wav", wav), model=WHISPER, response_format="verbose_json"
    )
    assert verbose.task == "translate" and verbose.segments
    # OpenAI's optional fields are taken: language, a prompt, a temperature.
    prompted = client.audio.transcriptions.create(
        file=("b.wav", wav),
        model=WHISPER,
        language="en",
        prompt="Quarterly finance report.",
        temperature=0.2,
    )
    assert wer(ref, prompted.text) < 0.5


def test_errors_are_openais(client, clips, endpoints: Endpoints) -> None:
    import openai

    _, wav = clips[1]
    with pytest.raises(openai.BadRequestError, match="English-only"):
        client.audio.transcriptions.create(file=("b.wav", wav), model=WHISPER, language="fr")
    with pytest.raises(openai.BadRequestError, match="word timestamps"):
        client.audio.transcriptions.create(
            file=("b.wav", wav),
            model=WHISPER,
            response_format="verbose_json",
            timestamp_granularities=["word"],
        )
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.audio.transcriptions.create(
            file=("b.wav", wav), model=WHISPER, response_format="mp3"
        )
    with pytest.raises(openai.BadRequestError, match="file: not a decodable audio file") as bad:
        client.audio.transcriptions.create(file=("b.wav", b"not audio at all"), model=WHISPER)
    assert bad.value.body["param"] == "file"
    with pytest.raises(openai.NotFoundError) as nf:
        client.audio.transcriptions.create(file=("b.wav", wav), model="no-such-whisper")
    assert nf.value.body["param"] == "model"
    url = endpoints.base_url + "/audio/transcriptions"
    files = {"file": ("b.wav", wav), "model": (None, WHISPER)}
    assert httpx.post(url, files=files, timeout=60).status_code == 401  # the guard: no key
    auth = {"Authorization": f"Bearer {endpoints.api_key}"}
    r = httpx.post(url, json={"model": WHISPER}, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(url, files={"model": (None, WHISPER)}, headers=auth, timeout=60)
    assert r.status_code == 400 and "file" in json.dumps(r.json()["error"])
    listed = {m.id: m.owned_by for m in client.models.list()}
    assert listed[WHISPER] == "omniflow:encoder"
    # Malformed forms are 400s naming the field, never a 500.
    for files, param in (
        ({"file": (None, "plain text, not a file"), "model": (None, WHISPER)}, "file"),
        ({"file": ("b.wav", wav), "model": (None, WHISPER), "temperature": (None, "hot")}, None),
        ({"file": ("b.wav", wav), "model": (None, WHISPER), "temperature": (None, "7")}, None),
        ({"file": ("b.wav", wav), "model": (None, WHISPER), "model2": (None, "x")}, None),
        ({"file": ("b.wav", b""), "model": (None, WHISPER)}, "file"),
    ):
        r = httpx.post(url, files=files, headers=auth, timeout=60)
        assert r.status_code == 400, (files.keys(), r.text)
        if param:
            assert r.json()["error"]["param"] == param
    broken = b"--xyz\r\nContent-Disposition: form-data; name=file\r\n\r\nabc"  # no end
    r = httpx.post(
        url,
        content=broken,
        headers={**auth, "content-type": "multipart/form-data; boundary=xyz"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
