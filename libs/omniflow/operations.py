"""The one table of operations: what each operation of a worker role takes and gives.

Every hop reads this table instead of declaring an operation again:

- the DSL (``omniflow.dsl``) checks a node's inputs and outputs against it and gives a
  ``phrased`` input whole phrases from a streaming edge;
- the coordinator's caller turns a node's inputs and params into the call ``rpc`` names
  (``Invoke``: the node's params merged into its inputs);
- the worker advertises the operations its role serves (``served``: ``always`` once its
  model is loaded, ``model`` only when that model can, e.g. ``transcribe`` with Whisper)
  and reads an ``Invoke``'s inputs by the declared names and kinds;
- the gateway maps a chat onto a workflow by what each workflow input reaches: the call
  inputs it feeds and their ``chat`` part (``omniflow.dsl.flow``), never by its name; and
  answers with what each workflow output carries: the ``answers`` part of the call outputs
  it holds (the reply's text, what was heard, the audio, the image, the token counts).

Operations a user registers for their own roles (``omniflow.dsl.register_operation``) are
:class:`Operation` records too, kept by the DSL of the process that registers them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omniflow.errors import InvalidArgument
from omniflow.values import VType

#: The roles a worker can serve (``OMNIFLOW_WORKER_ROLE``, a topology's ``role:``).
ROLES = ("llm", "encoder", "diffusion", "talker", "embed")

#: The parts of an OpenAI chat request an input can take (``Input.chat``): the last user
#: message's text, its ``input_audio`` file, the latest ``image_url`` data URL, the
#: conversation before it; for image requests also ``width``, ``height`` and ``seed``.
CHAT_PARTS = ("text", "audio", "image", "messages", "width", "height", "seed")

#: The parts of an OpenAI answer an output can carry (``Operation.answers``): the reply's
#: text, what was heard (a transcript), the spoken reply (PCM or a WAV) and its rate, the
#: image, and the token counts of the usage.
ANSWER_PARTS = (
    "text",
    "heard",
    "audio",
    "sample_rate",
    "image",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
)

#: The worker RPC of each built-in operation (anything else goes through ``Invoke``).
RPCS = ("Generate", "Encode", "GenerateImage", "Synthesize", "Invoke")

#: The longest phrase a ``phrased`` input gets from a ``.stream()`` edge with no length.
PHRASE_INPUT_CHARS = 400


@dataclass(frozen=True, slots=True)
class Input:
    """One input of an operation: its name, its kind, whether it may be left out.

    ``phrased``: a streaming edge feeds it whole phrases (sentences, at most
    ``PHRASE_INPUT_CHARS``) even when it asks for no phrase length: a prompt cut at every
    token would be one call per token, each on a word or two. ``chat``: the part of a chat
    request it takes (one of ``CHAT_PARTS``; "" for none)."""

    name: str
    kind: VType
    optional: bool = False
    phrased: bool = False
    chat: str = ""


@dataclass(frozen=True, slots=True)
class Param:
    """A node param an operation reads, its type(s) and its default (``choices``: the only
    values accepted, when it has such a list)."""

    name: str
    types: tuple[type, ...]
    default: object
    choices: tuple[object, ...] = ()


@dataclass(frozen=True, slots=True)
class Operation:
    """``role.name``: its inputs, outputs (name -> kind), params and the RPC that serves it.

    ``streams`` names the output whose partial values a call streams (``text`` deltas of
    ``llm.generate``, ``pcm`` chunks of ``talker.synthesize``); empty when unary.
    ``sampling``: its params also take the sampling contract's fields
    (``omniflow.sampling``). ``hints``: the input the router's KV hints of its Pick are
    made from ("" for none). ``answers``: output -> the part of an OpenAI answer it carries
    (one of ``ANSWER_PARTS``; outputs not named carry none)."""

    role: str
    name: str
    inputs: tuple[Input, ...]
    outputs: dict[str, VType]
    params: tuple[Param, ...] = ()
    rpc: str = "Invoke"
    streams: str = ""
    served: str = "always"
    sampling: bool = False
    hints: str = ""
    answers: dict[str, str] = field(default_factory=dict)

    @property
    def input_types(self) -> dict[str, VType]:
        return {i.name: i.kind for i in self.inputs}

    @property
    def optional(self) -> frozenset[str]:
        return frozenset(i.name for i in self.inputs if i.optional)

    @property
    def phrased(self) -> frozenset[str]:
        return frozenset(i.name for i in self.inputs if i.phrased)

    def input(self, name: str) -> Input | None:
        return next((i for i in self.inputs if i.name == name), None)

    def check_input_names(self, names: Iterable[str]) -> None:
        """InvalidArgument naming the given inputs this operation does not take."""
        unknown = set(names) - {i.name for i in self.inputs}
        if unknown:
            raise InvalidArgument(
                f"inputs {sorted(unknown)} are not taken by {self.name}; accepted: "
                + ", ".join(i.name for i in self.inputs)
            )

    def param(self, params: Mapping[str, Any], name: str) -> Any:
        """A node's value of param ``name`` (its default when unset); InvalidArgument when
        it has another type or is not one of the choices."""
        p = next((q for q in self.params if q.name == name), None)
        if p is None:
            raise KeyError(f"{self.role}.{self.name} declares no param {name!r}")
        value = params.get(name, p.default)
        if value is None and p.default is None:
            return None
        ok = isinstance(value, p.types) and not (isinstance(value, bool) and bool not in p.types)
        if not ok:
            accepted = " or ".join("a " + _TYPE_NAMES[t] for t in p.types)
            raise InvalidArgument(f"param {name!r} is {type(value).__name__}; accepted: {accepted}")
        if p.choices and value not in p.choices:
            raise InvalidArgument(
                f"param {name!r} is {value!r}; accepted: {', '.join(map(str, p.choices))}"
            )
        return value


_TYPE_NAMES = {str: "string", bool: "bool", int: "int", float: "number"}
_NUM = (int, float)

_GENERATE_INPUTS = (
    Input("prompt", VType.TEXT, phrased=True, chat="text"),  # the new user turn
    Input("session", VType.TEXT, optional=True),
    # the chat so far; an encoder's items (coordinator/conversation.py)
    Input("messages", VType.LIST, optional=True, chat="messages"),
    Input("media", VType.LIST, optional=True),
)
_GENERATE_OUTPUTS = {
    "text": VType.TEXT,
    "prompt_tokens": VType.INT,
    "cached_tokens": VType.INT,
    "completion_tokens": VType.INT,
    "finish_reason": VType.TEXT,
    # With param prefill_only: the prompt's stored pages, for another role to pull
    # ({kv_namespace, block_hashes, token_ids, node}; generate_image input ``pages``).
    "pages": VType.STRUCT,
}
_GENERATE_ANSWERS = {k: k for k in ("text", "prompt_tokens", "cached_tokens", "completion_tokens")}
_GENERATE_PARAMS = (
    Param("chat", (bool,), False),  # one user turn rendered with the model's chat template
    Param("system", (str,), ""),  # the system turn before it
    Param("media_turn", (str,), "first", ("first", "last")),  # where the media go
    Param("prefill_only", (bool,), False),  # store the prompt's pages, generate nothing
)


def _generate(role: str, hints: str = "") -> Operation:
    """``role.generate``: a prompt in, text out over ``Generate`` (llm, diffusion's backbone)."""
    return Operation(
        role,
        "generate",
        _GENERATE_INPUTS,
        _GENERATE_OUTPUTS,
        _GENERATE_PARAMS,
        rpc="Generate",
        streams="text",
        sampling=True,
        hints=hints,
        answers=_GENERATE_ANSWERS,
    )


OPERATIONS: tuple[Operation, ...] = (
    _generate("llm", hints="prompt"),
    # media: media items; image, audio: a file's bytes (at least one of the three)
    Operation(
        "encoder",
        "encode",
        (
            Input("media", VType.ANY, optional=True),
            Input("image", VType.ANY, optional=True, chat="image"),
            Input("audio", VType.ANY, optional=True, chat="audio"),
        ),
        {"items": VType.LIST, "cache_hits": VType.INT},
        rpc="Encode",
    ),
    # Through Invoke by an encoder with a Whisper model: audio file bytes in; the optional
    # inputs are OpenAI's transcription fields (segments with timestamps: true).
    Operation(
        "encoder",
        "transcribe",
        (
            Input("audio", VType.ANY, chat="audio"),
            Input("prompt", VType.TEXT, optional=True),
            Input("temperature", VType.FLOAT, optional=True),
            Input("language", VType.TEXT, optional=True),
            Input("task", VType.TEXT, optional=True),
            Input("timestamps", VType.BOOL, optional=True),
            Input("seed", VType.INT, optional=True),
        ),
        {
            "text": VType.TEXT,
            "duration": VType.FLOAT,
            "language": VType.TEXT,
            "segments": VType.LIST,
        },
        served="model",
        answers={"text": "heard"},
    ),
    # Through Invoke by an embed worker: texts or token id lists in, vectors out (float32
    # little-endian bytes, count x dim).
    Operation(
        "embed",
        "embed",
        (
            Input("texts", VType.LIST, optional=True),
            Input("token_ids", VType.LIST, optional=True),
            Input("dimensions", VType.INT, optional=True),
        ),
        {
            "embeddings": VType.BYTES,
            "dim": VType.INT,
            "count": VType.INT,
            "prompt_tokens": VType.INT,
        },
    ),
    # One of prompt (text, prefilled here) or pages (an llm's prefill_only pages, pulled);
    # width/height/steps/seed inputs override the node's params of the same name.
    Operation(
        "diffusion",
        "generate_image",
        (
            Input("prompt", VType.TEXT, optional=True, chat="text"),
            Input("pages", VType.STRUCT, optional=True),
            Input("width", VType.INT, optional=True, chat="width"),
            Input("height", VType.INT, optional=True, chat="height"),
            Input("steps", VType.INT, optional=True),
            Input("seed", VType.INT, optional=True, chat="seed"),
        ),
        {
            "image": VType.ANY,
            "width": VType.INT,
            "height": VType.INT,
            "prompt_tokens": VType.INT,
            "cached_prompt_tokens": VType.INT,
        },
        (
            Param("width", (int,), 0),  # 0: the model's default size
            Param("height", (int,), 0),
            Param("steps", (int,), 0),  # 0: the model's default
            Param("seed", (int,), None),  # unset: a random seed
            Param("guidance_scale", _NUM, 0.0),
            Param("negative_prompt", (str,), ""),
            Param("return_ref", (bool,), False),  # a TensorRef of the RGB pixels, not a PNG
        ),
        rpc="GenerateImage",
        hints="pages",
        answers={"image": "image"},
    ),
    _generate("diffusion"),  # the diffusion worker's backbone serves Generate too
    Operation(
        "talker",
        "synthesize",
        (Input("text", VType.TEXT, chat="text"),),
        {"pcm": VType.BYTES, "wav": VType.BYTES, "sample_rate": VType.INT},
        (
            Param("voice", (str,), ""),  # "": the talker's own voice
            Param("sample_rate", (int,), 0),  # 0: 16 kHz; 8 to 48 kHz resampled
        ),
        rpc="Synthesize",
        streams="pcm",
        answers={"pcm": "audio", "wav": "audio", "sample_rate": "sample_rate"},
    ),
)

_BY_NAME = {(op.role, op.name): op for op in OPERATIONS}


def operation(role: str, name: str) -> Operation | None:
    """The built-in operation ``role.name``, or None."""
    return _BY_NAME.get((role, name))


def served(role: str, *, model_can: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The operations a worker of ``role`` serves once its model is loaded: those it always
    serves, then those of ``model_can`` that the table lets its model add."""
    always = tuple(op.name for op in OPERATIONS if op.role == role and op.served == "always")
    extra = tuple(
        op.name
        for op in OPERATIONS
        if op.role == role and op.served == "model" and op.name in model_can
    )
    return always + extra
