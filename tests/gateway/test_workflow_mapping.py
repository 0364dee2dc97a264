"""Unit tests (no network): how a chat or image request maps onto a workflow's inputs and
which outputs answer it (on graphs compiled by the DSL), and the audio the gateway sends
(WAV, and pcm16 resampled to 24 kHz, checked with soundfile and soxr's one-shot resampler)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.dsl import Graph, VType, Workflow, register_operation
from omniflow.errors import InvalidArgument
from omniflow_services.gateway import audio
from omniflow_services.gateway.backends import workflow_info
from omniflow_services.gateway.types import WorkflowInfo
from omniflow_services.gateway.workflows import (
    Recall,
    answer_output,
    audio_output,
    audio_rate,
    chat_inputs,
    chat_turn,
    heard_key,
    heard_output,
    image_inputs,
    image_outputs,
    rate_output,
    usage_of,
)


def _info(wf: Workflow) -> WorkflowInfo:
    """What the gateway reads of the graph once it is registered."""
    return workflow_info(wf.compile())


def _spoken(rate: int | None = None) -> Workflow:
    """omni_chat's shape: a spoken question is heard, a typed one passed on, then answered
    in the chat so far."""
    wf = Workflow("spoken")
    audio_in = wf.input("audio", VType.BYTES, optional=True)
    text = wf.input("text", VType.TEXT, optional=True)
    history = wf.input("messages", VType.LIST, optional=True)

    def heard(g: Graph) -> dict:
        return {"said": g.call("asr", "encoder", "transcribe", audio=g.input("audio"))["text"]}

    question = wf.switch(
        "question",
        cases=[("spoken", audio_in.present(), heard)],
        default=lambda g: {"said": g.input("text")},
        outputs={"said": VType.TEXT},
        audio=audio_in,
        text=text,
    )
    answer = wf.call("answer", "llm", "generate", prompt=question["said"], messages=history)
    params = {"sample_rate": rate} if rate else {}
    speak = wf.call("speak", "talker", "synthesize", text=answer["text"], params=params)
    wf.output("text", answer["text"])
    wf.output("spoken", speak["wav"])
    return wf


def _audio_part(data: bytes) -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"},
    }


def test_chat_turn_splits_the_new_turn_from_history() -> None:
    recall = Recall(60.0)
    recall.put("audio:audio_1", "Paris is the capital.")
    recall.put(heard_key(b"first question"), "what is the capital of france")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [_audio_part(b"first question")]},
        {"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
        {"role": "user", "content": [{"type": "text", "text": "And "}, _audio_part(b"new")]},
    ]
    turn = chat_turn(messages, recall)
    assert turn.text == "And " and turn.audio is not None and turn.audio.data == b"new"
    assert turn.history == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "what is the capital of france"},
        {"role": "assistant", "content": "Paris is the capital."},
    ]
    info = _info(_spoken())
    inputs = chat_inputs(info, turn)
    assert inputs == {"audio": b"new", "text": "And ", "messages": turn.history}


def test_chat_turn_errors_name_the_message() -> None:
    recall = Recall(60.0)
    with pytest.raises(InvalidArgument, match=r"messages\[0\]\.audio\.id 'gone'"):
        chat_turn(
            [
                {"role": "assistant", "content": None, "audio": {"id": "gone"}},
                {"role": "user", "content": "hi"},
            ],
            recall,
        )
    with pytest.raises(InvalidArgument, match=r"messages\[1\] follows the last user message"):
        chat_turn([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], recall)
    bad = [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}]
    with pytest.raises(InvalidArgument, match=r"messages\[0\]\.content\[0\]\.input_audio\.data"):
        chat_turn([{"role": "user", "content": bad}], recall)


def test_required_inputs_a_chat_cannot_give_are_named() -> None:
    wf = Workflow("needs")
    question = wf.input("question", VType.TEXT)
    seen = wf.call("see", "encoder", "encode", image=wf.input("image", VType.MEDIA))
    answer = wf.call("a", "llm", "generate", prompt=question, media=seen["items"])
    wf.output("echo", answer["text"])
    info = _info(wf)
    turn = chat_turn([{"role": "user", "content": "hi"}], Recall(1.0))
    with pytest.raises(InvalidArgument, match="needs input 'image': send an image_url"):
        chat_inputs(info, turn)
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()
    content = [{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "hi"}]
    turn = chat_turn([{"role": "user", "content": content}], Recall(1.0))
    inputs = chat_inputs(info, turn)
    item = inputs["image"]
    assert isinstance(item, common_pb2.MediaItem) and item.data == b"\x89PNG"
    assert item.kind == common_pb2.MediaItem.KIND_IMAGE and inputs["question"] == "hi"
    empty = chat_turn([{"role": "user", "content": [_audio_part(b"x")]}], Recall(1.0))
    with pytest.raises(InvalidArgument, match="no text, and workflow 'needs' needs its text"):
        chat_inputs(info, empty)


def test_inputs_are_found_by_what_they_reach_not_by_name() -> None:
    wf = Workflow("named-oddly")
    ask = wf.input("zzz", VType.TEXT)
    wf.input("text", VType.TEXT, optional=True)  # reaches nothing: gets nothing
    past = wf.input("before", VType.LIST, optional=True)
    wf.output("answer", wf.call("a", "llm", "generate", prompt=ask, messages=past)["text"])
    info = _info(wf)
    assert info.takes == {
        "zzz": frozenset({"text"}),
        "text": frozenset(),
        "before": frozenset({"messages"}),
    }
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    turn = chat_turn([*history, {"role": "user", "content": "and you?"}], Recall(1.0))
    assert chat_inputs(info, turn) == {"zzz": "and you?", "before": history}


def test_a_workflow_whose_inputs_do_not_say_is_a_400_naming_what_is_missing() -> None:
    register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})
    wf = Workflow("upper")
    wf.output("text", wf.call("u", "echo", "upper", text=wf.input("question", VType.TEXT))["text"])
    info = _info(wf)
    turn = chat_turn([{"role": "user", "content": "hi"}], Recall(1.0))
    with pytest.raises(InvalidArgument, match="needs input 'question', which a chat request"):
        chat_inputs(info, turn)
    with pytest.raises(
        InvalidArgument,
        match=r"workflow 'upper' has no input that takes the text: none of its inputs "
        r"\(question\) reaches an input that takes it \(llm.generate prompt",
    ):
        image_inputs(info, "a cat", None, None)
    two = Workflow("two")
    for name in ("a", "b"):
        two.output(
            name, two.call(name, "llm", "generate", prompt=two.input(name, VType.TEXT))["text"]
        )
    with pytest.raises(InvalidArgument, match=r"'two' has 2 inputs that take the chat's text"):
        chat_inputs(_info(two), turn)


def test_a_list_a_map_goes_over_takes_no_chat_text() -> None:
    wf = Workflow("fan")  # examples/workflows/fanout.py's shape

    def answer(g: Graph) -> dict:
        return {"a": g.call("answer", "llm", "generate", prompt=g.input("item"))["text"]}

    wf.output("answers", wf.map("each", over=wf.input("questions", VType.LIST), body=answer)["a"])
    info = _info(wf)
    assert info.takes == {"questions": frozenset()}
    turn = chat_turn([{"role": "user", "content": "hi"}], Recall(1.0))
    with pytest.raises(InvalidArgument, match="needs input 'questions', which a chat request"):
        chat_inputs(info, turn)


def test_answer_and_audio_outputs() -> None:
    info = _info(_spoken())
    assert answer_output(info) == "text"
    # Not named audio: found as the talker node's output.
    assert audio_output(info) == "spoken" and audio_rate(info, "spoken") == 16000
    assert audio_rate(_info(_spoken(22050)), "spoken") == 22050
    wf = Workflow("mute")
    wf.output("answer", wf.call("a", "llm", "generate", prompt=wf.input("q", VType.TEXT))["text"])
    assert audio_output(_info(wf)) is None


def test_image_inputs_and_outputs() -> None:
    wf = Workflow("draw")
    prompt = wf.input("prompt", VType.TEXT)
    w = wf.input("w", VType.INT, optional=True)
    h = wf.input("h", VType.INT, optional=True)
    draw = wf.call("draw", "diffusion", "generate_image", prompt=prompt, width=w, height=h)
    wf.output("picture", draw["image"])
    wf.output("prompt_used", prompt)
    info = _info(wf)
    assert image_inputs(info, "a cat", (32, 48), None) == {"prompt": "a cat", "w": 32, "h": 48}
    assert image_inputs(info, "a cat", None, None) == {"prompt": "a cat"}
    fixed = Workflow("fixed")  # inputs named width/height that reach no image size
    fixed.input("width", VType.INT, optional=True)
    fixed.input("height", VType.INT, optional=True)
    pic = fixed.call("draw", "diffusion", "generate_image", prompt=fixed.input("p", VType.TEXT))
    fixed.output("image", pic["image"])
    with pytest.raises(InvalidArgument, match=r"^size: workflow 'fixed' sets its own image size"):
        image_inputs(_info(fixed), "a cat", (32, 32), None)
    with pytest.raises(InvalidArgument, match=r"^seed: workflow 'draw' has no seed input"):
        image_inputs(info, "a cat", None, 3)
    assert image_outputs(info) == ("picture", "prompt_used")


def test_recall_expires_and_is_bounded() -> None:
    recall = Recall(ttl_s=-1.0)
    recall.put("a", "x")
    assert recall.get("a") is None
    recall = Recall(ttl_s=60.0, max_entries=2)
    for key in "abc":
        recall.put(key, key)
    assert [recall.get(k) for k in "abc"] == [None, "b", "c"]


def test_pcm16_is_24khz_and_wav_keeps_the_rate() -> None:
    import soundfile as sf
    import soxr

    rate = 16000
    t = np.arange(rate) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes()
    wav = audio.encode(pcm, rate, "wav")
    samples, got = sf.read(io.BytesIO(wav), dtype="int16")
    assert got == rate and samples.tobytes() == pcm
    assert audio.encode(wav, 0, "wav") == wav  # a WAV is sent as it is
    # Streamed in odd-sized chunks (split samples too), as one signal.
    stream = audio.PcmResampler(rate, audio.PCM16_RATE)
    parts = [stream(pcm[i : i + 999]) for i in range(0, len(pcm), 999)]
    out = np.frombuffer(b"".join(parts) + stream(b"", last=True), dtype="<i2")
    whole = np.frombuffer(audio.encode(wav, 0, "pcm16"), dtype="<i2")
    assert len(out) == len(whole) == audio.PCM16_RATE
    ref = soxr.resample(np.frombuffer(pcm, dtype="<i2").astype(np.float32), rate, 24000)
    assert np.abs(whole.astype(np.float32) - ref).max() <= 2.0
    assert np.abs(out.astype(np.float32) - ref).max() <= 2.0


def test_voice_names() -> None:
    assert audio.talker_voice("alloy") == "" and audio.talker_voice("Shimmer") == ""
    assert audio.talker_voice("en_US-joe-medium") == "en_US-joe-medium"
    audio.check_chat_voice("cedar")
    with pytest.raises(InvalidArgument, match=r"audio\.voice 'zz' is not served; accepted: alloy"):
        audio.check_chat_voice("zz")


def _example(name: str) -> object:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "workflows" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_outputs_are_found_by_what_they_carry_not_by_name() -> None:
    wf = Workflow("odd-outputs")
    ask = wf.input("q", VType.TEXT)
    draft = wf.call("draft", "llm", "generate", prompt=ask)
    final = wf.call("final", "llm", "generate", prompt=draft["text"])
    speak = wf.call("say", "talker", "synthesize", text=final["text"], params={"sample_rate": 8000})
    wf.output("zz_draft", draft["text"])  # rewritten by the call that gives 'reply'
    wf.output("reply", final["text"])
    wf.output("noise", speak["wav"])
    wf.output("hz", speak["sample_rate"])
    wf.output("used", final["prompt_tokens"])
    wf.output("wrote", final["completion_tokens"])
    wf.output("before", draft["completion_tokens"])
    info = _info(wf)
    assert answer_output(info) == "reply"
    assert audio_output(info) == "noise" and rate_output(info, "noise") == "hz"
    assert heard_output(info) is None
    outputs = {"used": 5, "wrote": 7, "before": 2, "reply": "hi", "hz": 8000}
    assert usage_of(info, outputs) == (5, 0, 9)  # completions of both calls shown, summed
    assert info.carries["zz_draft"].feeds == frozenset({"reply", "used", "wrote"})


def test_an_answer_that_is_only_heard_and_one_a_user_operation_gives() -> None:
    hear = Workflow("hear")
    said = hear.call("asr", "encoder", "transcribe", audio=hear.input("a", VType.BYTES))
    hear.output("words", said["text"])
    hear.output("copy", said["text"])  # the same call's value: either answers
    info = _info(hear)
    assert answer_output(info) == "words" and heard_output(info) == "words"
    register_operation("echo", "shout", {"text": VType.TEXT}, {"loud": VType.TEXT})
    mine = Workflow("mine")
    mine.output("x", mine.call("s", "echo", "shout", text=mine.input("t", VType.TEXT))["loud"])
    assert answer_output(_info(mine)) == "x"


def test_no_output_a_chat_can_show_or_two_answers_are_400s_naming_them() -> None:
    wf = Workflow("counts")
    wf.output(
        "n", wf.call("a", "llm", "generate", prompt=wf.input("q", VType.TEXT))["cached_tokens"]
    )
    with pytest.raises(
        InvalidArgument,
        match=r"workflow 'counts' has no output a chat can show: none of its outputs \(n\) "
        r"carries a reply's text \(llm.generate text",
    ):
        answer_output(_info(wf))
    two = Workflow("two-answers")
    q = two.input("q", VType.TEXT)
    for name in ("left", "right"):
        two.output(name, two.call(name, "llm", "generate", prompt=q)["text"])
    with pytest.raises(InvalidArgument, match=r"2 outputs that carry the answer's text \(left, r"):
        answer_output(_info(two))
    mute = Workflow("mute-draw")
    pic = mute.call("d", "diffusion", "generate_image", prompt=mute.input("p", VType.TEXT))
    mute.output("w", pic["width"])
    with pytest.raises(InvalidArgument, match=r"'mute-draw' has no image output \(none of its"):
        image_outputs(_info(mute))


def test_the_examples_answer_by_what_their_outputs_carry() -> None:
    omni = _example("omni_chat")
    for wf in (omni.omni_chat, omni.omni_chat_e2e):
        info = _info(wf)
        assert answer_output(info) == "text" and audio_output(info) == "audio"
        assert rate_output(info, "audio") == "sample_rate"
    assert heard_output(_info(omni.omni_chat)) == "transcript"
    assert heard_output(_info(omni.omni_chat_e2e)) is None
    # The prompt drawn is the rewrite the prefill_only call stored the pages of.
    assert image_outputs(_info(_example("imagegen").imagegen)) == ("image", "prompt_used")
    assert answer_output(_info(_example("chain").chain)) == "answer"
    assert answer_output(_info(_example("switch").route)) == "answer"
    assert answer_output(_info(_example("loop").refine)) == "text"
