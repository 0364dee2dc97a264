"""Workflows served as OpenAI models (``workflow:<name>``), free of HTTP: a chat turn or an
image prompt becomes the workflow's inputs, its outputs become the answer's text, audio and
image.

What a chat gives goes to the workflow input that takes it, never guessed from a name: an
input takes the chat parts of the call inputs it reaches (``WorkflowInfo.takes``, from the
table of operations, ``omniflow.operations``; any other required input is a 400 that names
it, and so is a part that two inputs take):

- ``text`` (an input reaching ``llm.generate``'s ``prompt``, ``talker.synthesize``'s
  ``text`` or ``diffusion.generate_image``'s ``prompt``): the last user message's text;
- ``audio`` (reaching ``encoder.transcribe``'s or ``encoder.encode``'s ``audio``): the last
  user message's ``input_audio`` part (the file's bytes; a media item for a MEDIA input);
- ``image`` (``encoder.encode``'s ``image``): the latest ``image_url`` data URL of any user
  message (the conversation's image, sent again each turn so that its pages are reused);
- ``messages`` (``llm.generate``'s ``messages``): the conversation before the last user
  message, ``[{role, content}]`` as text, system messages included; an earlier spoken turn
  stands as what was heard, an assistant ``audio: {id}`` as its transcript (both remembered
  by :class:`Recall`).

What the answer takes is what each workflow output carries, never guessed from a name: the
answer parts of the call outputs it holds (``WorkflowInfo.carries``, from the table's
``answers``, ``omniflow.dsl.flow.output_flow``):

- the reply's text: the output carrying ``text`` (``llm.generate``'s text; a TEXT output of
  an operation outside the table), else ``heard`` (``encoder.transcribe``'s text); of several,
  the one no later call rewrites (``draft`` fed into the call that writes ``answer``); two
  from different calls, neither rewritten, are a 400 naming them;
- the spoken reply: the output carrying ``audio`` (``talker.synthesize``'s wav or pcm), and
  its rate from the one carrying that talker's ``sample_rate``;
- what was heard: the output carrying ``heard`` (remembered for later turns);
- the usage: the outputs carrying ``prompt_tokens``, ``cached_tokens``,
  ``completion_tokens`` (summed when several do);
- an image request's PNG: the output carrying ``image`` (``diffusion.generate_image``'s
  image), and as ``revised_prompt`` an output holding the prompt that call draws.

A workflow with no output the answer can take is a 400 that says what is missing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omniflow.api.common.v1 import common_pb2
from omniflow.errors import InvalidArgument, OmniflowError
from omniflow.operations import OPERATIONS, operation
from omniflow.values import VType
from omniflow_services.gateway.audio import TALKER_DEFAULT_RATE
from omniflow_services.gateway.types import MediaPart, WorkflowInfo

USAGE_PARTS = ("prompt_tokens", "cached_tokens", "completion_tokens")
AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg"}
_BINARY = (VType.ANY, VType.BYTES, VType.MEDIA)
# The kinds of workflow input that can hold each chat part.
_KINDS = {
    "text": (VType.ANY, VType.TEXT),
    "audio": _BINARY,
    "image": _BINARY,
    "messages": (VType.ANY, VType.LIST),
    "width": (VType.ANY, VType.INT),
    "height": (VType.ANY, VType.INT),
    "seed": (VType.ANY, VType.INT),
}


class Recall:
    """Text that stands for audio in later turns: what the gateway answered (by audio id)
    and what a workflow heard (by the audio's hash). Bounded; entries expire."""

    def __init__(self, ttl_s: float, max_entries: int = 4096) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def put(self, key: str, text: str) -> None:
        self._items[key] = (time.monotonic() + self.ttl_s, text)
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, key: str) -> str | None:
        item = self._items.get(key)
        if item is None or item[0] < time.monotonic():
            self._items.pop(key, None)
            return None
        return item[1]


def heard_key(audio: bytes) -> str:
    return "heard:" + hashlib.blake2b(audio, digest_size=16).hexdigest()


@dataclass(slots=True)
class ChatTurn:
    """A chat as a workflow sees it: the new user turn and what came before."""

    text: str = ""
    audio: MediaPart | None = None
    image: MediaPart | None = None
    history: list[dict[str, str]] = field(default_factory=list)


def data_url(url: str, where: str) -> MediaPart:
    """The bytes of a ``data:<mime>;base64,...`` URL (remote URLs are not fetched)."""
    head, sep, data = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise InvalidArgument(
            f"{where}: only data URLs are accepted (data:image/png;base64,...); this "
            "server does not fetch remote images"
        )
    mime = head.removeprefix("data:").removesuffix(";base64")
    return MediaPart(_b64(data, where, "the data URL"), mime or "image/png")


def input_audio(part: dict[str, Any], where: str) -> MediaPart:
    """An ``input_audio`` content part's file bytes."""
    audio = part["input_audio"]
    raw = _b64(audio["data"], f"{where}.input_audio.data", "input_audio.data")
    if not raw:
        raise InvalidArgument(f"{where}.input_audio.data is empty: send the audio file, base64")
    return MediaPart(raw, AUDIO_MIME.get(audio["format"], "audio/wav"))


def _b64(data: str, where: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{where}: {what} is not valid base64") from None


def chat_turn(messages: Sequence[dict[str, Any]], recall: Recall) -> ChatTurn:
    """The new user turn (the last user message) and the conversation before it."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), -1)
    if last < 0:
        raise InvalidArgument("messages has no user message: a workflow's input is one")
    if last != len(messages) - 1:
        raise InvalidArgument(
            f"messages[{last + 1}] follows the last user message: a workflow answers the last "
            "user turn, so send the conversation up to it"
        )
    turn = ChatTurn()
    for i, m in enumerate(messages):
        content = m.get("content")
        texts: list[str] = []
        audio: MediaPart | None = None
        for j, part in enumerate(content if isinstance(content, list) else []):
            where = f"messages[{i}].content[{j}]"
            if part["type"] == "text":
                texts.append(part["text"])
            elif part["type"] == "input_audio":
                audio = input_audio(part, where)
            elif part["type"] == "image_url":
                turn.image = data_url(part["image_url"]["url"], f"{where}.image_url.url")
        text = content if isinstance(content, str) else "".join(texts)
        if i == last:
            turn.text, turn.audio = text, audio
        elif m["role"] == "system":
            turn.history.append({"role": "system", "content": text})
        else:
            turn.history.append({"role": m["role"], "content": _said(m, i, text, audio, recall)})
    return turn


def _said(m: dict[str, Any], i: int, text: str, audio: MediaPart | None, recall: Recall) -> str:
    """A past message as text: its own, else the transcript of its audio."""
    if text:
        return text
    ref = m.get("audio")
    if ref is not None:
        said = recall.get(f"audio:{ref['id']}")
        if said is None:
            raise InvalidArgument(
                f"messages[{i}].audio.id {ref['id']!r} is unknown or expired: send the "
                "assistant's transcript as its content instead"
            )
        return said
    if audio is not None:
        return recall.get(heard_key(audio.data)) or ""
    return ""


def _media_value(part: MediaPart, vtype: int, kind: int) -> Any:
    if vtype == VType.MEDIA:
        return common_pb2.MediaItem(kind=kind, data=part.data, mime_type=part.mime_type)  # type: ignore[arg-type]
    return part.data


def _takers(part: str) -> str:
    """The call inputs of the table that take ``part``, for error messages."""
    return ", ".join(
        f"{op.role}.{op.name} {i.name}" for op in OPERATIONS for i in op.inputs if i.chat == part
    )


def taking(info: WorkflowInfo, part: str) -> str | None:
    """The input of ``info`` that takes the chat part ``part`` (None when none does); a 400
    when several do, as the gateway cannot tell which one the request means."""
    ports = [
        p
        for p, vtype, _ in info.inputs
        if part in info.takes.get(p, ()) and vtype in _KINDS.get(part, (VType.ANY,))
    ]
    if len(ports) > 1:
        raise InvalidArgument(
            f"workflow {info.name!r} has {len(ports)} inputs that take the chat's {part} "
            f"({', '.join(ports)}: each reaches {_takers(part)}), so a request cannot say "
            "which one it fills; run it through the coordinator's API instead"
        )
    return ports[0] if ports else None


def text_input(info: WorkflowInfo) -> str:
    """The input a prompt's text goes to; a 400 naming what is missing when none takes it."""
    port = taking(info, "text")
    if port is None:
        names = ", ".join(p for p, _, _ in info.inputs) or "none"
        raise InvalidArgument(
            f"workflow {info.name!r} has no input that takes the text: none of its inputs "
            f"({names}) reaches an input that takes it ({_takers('text')})"
        )
    return port


def chat_inputs(info: WorkflowInfo, turn: ChatTurn) -> dict[str, Any]:
    """The inputs of one run of ``info`` for a chat turn."""
    name = info.name
    text_port = taking(info, "text")
    parts = {part: taking(info, part) for part in ("audio", "image", "messages")}
    media = {
        "audio": (
            turn.audio,
            common_pb2.MediaItem.KIND_AUDIO,
            "an input_audio content part in the last user message",
        ),
        "image": (turn.image, common_pb2.MediaItem.KIND_IMAGE, "an image_url part (a data URL)"),
    }
    inputs: dict[str, Any] = {}
    for port, vtype, optional in info.inputs:
        if port == parts["messages"]:
            if turn.history or not optional:
                inputs[port] = turn.history
        elif port in (parts["audio"], parts["image"]):
            part, kind, how = media["audio" if port == parts["audio"] else "image"]
            if part is not None:
                inputs[port] = _media_value(part, vtype, kind)
            elif not optional:
                raise InvalidArgument(f"workflow {name!r} needs input {port!r}: send {how}")
        elif port == text_port:
            if turn.text:
                inputs[port] = turn.text
            elif not optional:
                raise InvalidArgument(
                    f"the last user message has no text, and workflow {name!r} needs its "
                    f"text input {port!r}"
                )
        elif not optional:
            raise InvalidArgument(
                f"workflow {name!r} needs input {port!r}, which a chat request cannot give (it "
                "reaches no call input that takes a part of a chat: text, audio, image or "
                "messages); run it through the coordinator's API instead"
            )
    return inputs


def _givers(part: str) -> str:
    """The call outputs of the table that carry ``part``, for error messages."""
    return ", ".join(
        f"{op.role}.{op.name} {out}"
        for op in OPERATIONS
        for out, p in op.answers.items()
        if p == part
    )


def _ordered(info: WorkflowInfo) -> list[str]:
    """The outputs of ``info`` in the order the graph declares them (its output ports; the
    outputs map of a graph message has no order of its own)."""
    order = [o for o in info.output_types if o in info.outputs]
    return order + sorted(set(info.outputs) - set(order))


def _carrying(info: WorkflowInfo, part: str) -> list[str]:
    """The outputs of ``info`` that carry ``part``, in declaration order."""
    flows = info.carries
    return [o for o in _ordered(info) if o in flows and part in flows[o].parts]


def carrying(info: WorkflowInfo, part: str) -> str | None:
    """The output of ``info`` that carries the answer part ``part`` (None when none does):
    of several, those no later call rewrites into another of them; a 400 when those still
    come from different calls, as the gateway cannot tell which one answers."""
    flows = info.carries
    given = _carrying(info, part)
    last = [o for o in given if not any(f in given for f in flows[o].feeds)]
    if len({flows[o].calls for o in last}) > 1:
        raise InvalidArgument(
            f"workflow {info.name!r} has {len(last)} outputs that carry the answer's {part} "
            f"({', '.join(last)}: each holds {_givers(part) or 'a TEXT output'} of another "
            "call, and no call rewrites one into another), so the gateway cannot tell which "
            "one answers; run it through the coordinator's API instead"
        )
    return last[0] if last else None


def answer_output(info: WorkflowInfo, audio_out: str | None = None) -> str:
    """The output whose text answers: the one carrying the reply's ``text``, else what was
    ``heard``; "" when only ``audio_out`` answers (a spoken reply with no text); a 400
    naming what is missing when none."""
    found = carrying(info, "text") or carrying(info, "heard")
    if found is not None:
        return found
    if audio_out is not None:
        return ""
    names = ", ".join(_ordered(info)) or "none"
    raise InvalidArgument(
        f"workflow {info.name!r} has no output a chat can show: none of its outputs ({names}) "
        f"carries a reply's text ({_givers('text')}, or a TEXT output of an operation of "
        f"your own) or a transcript ({_givers('heard')})"
    )


def audio_output(info: WorkflowInfo) -> str | None:
    """The output that holds the spoken answer (``talker.synthesize``'s wav or pcm), if the
    workflow has one."""
    return carrying(info, "audio")


def no_audio(info: WorkflowInfo) -> str:
    """Why ``info`` cannot speak, for a 400."""
    return (
        f"workflow {info.name!r} has no audio output (none of its outputs carries "
        f"{_givers('audio')})"
    )


def rate_output(info: WorkflowInfo, audio_out: str) -> str | None:
    """The output carrying the ``sample_rate`` of the talker that gives ``audio_out``."""
    calls = info.carries[audio_out].calls
    return next((o for o in _carrying(info, "sample_rate") if info.carries[o].calls & calls), None)


def heard_output(info: WorkflowInfo) -> str | None:
    """The output carrying what the run heard (``encoder.transcribe``'s text), if any."""
    heard = _carrying(info, "heard")
    return heard[0] if heard else None


def streamed(info: WorkflowInfo, node: str) -> str:
    """The output a top-level call node streams (the table's ``streams``; "" when none)."""
    call = info.nodes.get(node)
    op = operation(call.role, call.operation) if call is not None else None
    return op.streams if op is not None else ""


def audio_rate(info: WorkflowInfo, output: str) -> int:
    """The rate of the PCM a talker node streams: its ``sample_rate`` param, else the
    talker default (16 kHz)."""
    call = info.nodes.get(info.outputs.get(output, ""))
    rate = call.params.get("sample_rate", 0) if call is not None else 0
    return int(rate) if isinstance(rate, int) and rate > 0 else TALKER_DEFAULT_RATE


def usage_of(info: WorkflowInfo, outputs: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of a run: the outputs carrying each, summed (0
    when none does)."""
    p, c, n = (
        sum(
            v
            for o, flow in info.carries.items()
            if part in flow.parts
            and isinstance(v := outputs.get(o), int)
            and not isinstance(v, bool)
        )
        for part in USAGE_PARTS
    )
    return p, c, n


def image_inputs(
    info: WorkflowInfo, prompt: str, size: tuple[int, int] | None, seed: int | None
) -> dict[str, Any]:
    """The inputs of one run of an image workflow: the prompt, ``size`` as ``width`` and
    ``height`` and ``seed``, each to the input that takes it (a 400 when none does)."""
    inputs: dict[str, Any] = {text_input(info): prompt}
    if size is not None:
        width, height = taking(info, "width"), taking(info, "height")
        if width is None or height is None:
            raise InvalidArgument(
                f"size: workflow {info.name!r} sets its own image size (no inputs of it reach "
                f"{_takers('width')} and {_takers('height')}); leave size unset"
            )
        inputs[width], inputs[height] = size
    if seed is not None:
        port = taking(info, "seed")
        if port is None:
            raise InvalidArgument(
                f"seed: workflow {info.name!r} has no seed input (none reaches "
                f"{_takers('seed')}); leave seed unset"
            )
        inputs[port] = seed
    for p, _, optional in info.inputs:
        if p not in inputs and not optional:
            raise InvalidArgument(
                f"workflow {info.name!r} needs input {p!r}, which an image request cannot give"
            )
    return inputs


def image_outputs(info: WorkflowInfo) -> tuple[str, str | None]:
    """(the output holding the PNG, the output holding the prompt that was drawn): the
    outputs carrying ``diffusion.generate_image``'s image and the prompt it draws."""
    image = carrying(info, "image")
    if image is None:
        raise InvalidArgument(
            f"workflow {info.name!r} has no image output (none of its outputs carries "
            f"{_givers('image')}): it cannot serve /v1/images/generations"
        )
    drawn = [o for o in _ordered(info) if o in info.carries and info.carries[o].drawn]
    # A prompt a call wrote (the rewrite) over the user's own words passed on.
    revised = next((o for o in drawn if info.carries[o].calls), drawn[0] if drawn else None)
    return image, revised


def png_of(value: Any, name: str) -> bytes:
    """A run's image output as PNG bytes."""
    if isinstance(value, common_pb2.MediaItem) and value.WhichOneof("source") == "data":
        value = value.data
    if not isinstance(value, bytes):  # the workflow's fault, not the request's: a 500
        raise OmniflowError(
            f"the workflow's output {name!r} is a {type(value).__name__}, not the image's "
            "bytes (a diffusion node with return_ref gives a reference the gateway cannot "
            "send)"
        )
    return value
