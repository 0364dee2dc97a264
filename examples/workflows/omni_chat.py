"""Omni-modal dialogue, two forms of one turn: the talker speaks while the llm writes.

    omniflow up
    omniflow workflow register examples/workflows/omni_chat.py
    omniflow run omni_chat --input audio=question.wav          # writes the answer's WAV
    omniflow run omni_chat --input text="What is a cache?"     # a typed question
    omniflow run omni_chat_e2e --input image=photo.png --input text="What is in it?"

``omni_chat`` (cascaded, real models on the default topology): the encoder's Whisper
tiny.en ``transcribe``s the spoken question; the llm (SmolLM2-135M-Instruct) answers it as
the last user turn of the chat ``messages`` (node param ``chat``: rendered with the model's
own template); the talker (a Piper voice) speaks the answer while it is written: the edge
into the talker is a streaming one that hands over whole phrases (``phrase_chars``), so
speech starts on the first phrase, not after the whole answer and not once per token.

``omni_chat_e2e`` (end to end, as the paper does): the image and/or audio go to the
encoder, whose embeddings stay in the data plane (``TensorRef``s); the llm reads them in
place of media placeholders in the first user turn. The vision tower and the projectors
from Whisper's states into the llm are generated (random weights: no such weights can be
installed here), so the answer says little about the picture; what this form shows is the
data path and the reuse: send the same media each turn with the history in ``messages``,
and turn 2 reuses turn 1's pages through the history and the media span
(``cached_tokens``).

Inputs and outputs (the gateway maps OpenAI requests onto these names):

- ``audio`` (file bytes, any common format), ``text`` (typed question), ``messages``
  (history ``[{role, content}]``, oldest first, without the new question; a ``system``
  entry is the system prompt); ``omni_chat_e2e`` also ``image`` (file bytes).
- ``transcript`` (cascaded: what was heard, or the typed ``text``), ``text`` (the reply),
  ``audio`` (the spoken reply, one WAV), ``sample_rate``, ``prompt_tokens``,
  ``cached_tokens``, ``completion_tokens``, ``finish_reason``.
- Streamed as the run goes: node ``answer`` output ``text`` (reply deltas) and node
  ``speak`` output ``pcm`` (16-bit mono PCM at ``sample_rate``, in order).
"""

from omniflow.dsl import Graph, Retry, VType, Workflow

#: The longest stretch the talker gets without a phrase boundary (characters).
PHRASE_CHARS = 120
LLM = {"chat": True, "max_tokens": 48, "temperature": 0.0}
SYSTEM = "You are a helpful voice assistant. Answer briefly, in one or two sentences."


def _heard(g: Graph) -> dict:
    said = g.call("transcribe", "encoder", "transcribe", audio=g.input("audio"), retry=Retry(2))
    return {"transcript": said["text"]}


def _typed(g: Graph) -> dict:
    return {"transcript": g.input("text")}


def _speak_and_answer(wf: Workflow, answer_inputs: dict) -> None:
    answer = wf.call(
        "answer",
        "llm",
        "generate",
        params={**LLM, "system": SYSTEM},
        retry=Retry(2),
        timeout_ms=120_000,
        **answer_inputs,
    )
    speak = wf.call(
        "speak",
        "talker",
        "synthesize",
        text=answer["text"].stream(phrase_chars=PHRASE_CHARS),
        timeout_ms=120_000,
    )
    wf.output("text", answer["text"])
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason"):
        wf.output(name, answer[name])
    wf.output("audio", speak["wav"])
    wf.output("sample_rate", speak["sample_rate"])


omni_chat = Workflow(
    "omni_chat",
    description="spoken question -> transcribe -> chat llm -> talker speaking each phrase",
    deadline_ms=300_000,
)
_audio = omni_chat.input("audio", VType.ANY, optional=True, description="audio file bytes")
_text = omni_chat.input("text", VType.TEXT, optional=True, description="a typed question")
_history = omni_chat.input(
    "messages", VType.LIST, optional=True, description="the chat so far: [{role, content}]"
)
_question = omni_chat.switch(
    "question",
    cases=[("spoken", _audio.present(), _heard)],
    default=_typed,
    outputs={"transcript": VType.TEXT},
    audio=_audio,
    text=_text,
)
omni_chat.output("transcript", _question["transcript"])
_speak_and_answer(omni_chat, {"prompt": _question["transcript"], "messages": _history})


omni_chat_e2e = Workflow(
    "omni_chat_e2e",
    description="image/audio -> encoder embeddings (TensorRefs) -> llm with media -> talker",
    deadline_ms=300_000,
)
_image = omni_chat_e2e.input("image", VType.ANY, optional=True, description="image file bytes")
_sound = omni_chat_e2e.input("audio", VType.ANY, optional=True, description="audio file bytes")
_ask = omni_chat_e2e.input("text", VType.TEXT, optional=True, description="the question")
_past = omni_chat_e2e.input(
    "messages", VType.LIST, optional=True, description="the chat so far: [{role, content}]"
)
_media = omni_chat_e2e.call(
    "encode", "encoder", "encode", image=_image, audio=_sound, retry=Retry(2)
)
omni_chat_e2e.output("encoder_cache_hits", _media["cache_hits"])
_speak_and_answer(omni_chat_e2e, {"prompt": _ask, "messages": _past, "media": _media["items"]})
