"""A model's own chat template, rendered the way transformers' ``apply_chat_template`` renders it.

The environment matches transformers': a jinja2 ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that does not HTML-escape, and the globals ``raise_exception``, ``strftime_now``, ``dict``
and ``namespace``. The template sees ``messages``, ``add_generation_prompt``, the named
special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) and any
extra keyword arguments, which override the special tokens as in transformers.

The template comes from ``chat_template.jinja`` (what transformers 5 writes) or from
``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates of
which ``default`` is used).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from omniflow.errors import InvalidArgument

#: The named special tokens transformers passes to every template.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

#: What a media part becomes inside the rendered prompt; the multimodal path splits the
#: prompt at these (services/worker/mm/prompt.py ``PLACEHOLDER``).
MEDIA_PLACEHOLDERS = {"image": "<|image|>", "audio": "<|audio|>"}
_MEDIA_PART_TYPES = {
    "image": "image",
    "image_url": "image",
    "input_image": "image",
    "audio": "audio",
    "input_audio": "audio",
    "audio_url": "audio",
}

# ``content`` is handed to templates as a string unless the template itself walks a list
# of parts (as multimodal templates do): that is what templates written for string content
# expect, and what vLLM does ("string" vs "openai" content format).
STRING_CONTENT = "string"
PARTS_CONTENT = "openai"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; transformers' does not, and templates rely on that.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict`` for templates (``dict(a=1)``, ``dict.fromkeys``) without handing them the
    type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` without underscore attributes (a sandbox hardening)."""

    # No named self: jinja passes a "self" key through as a namespace attribute.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace: {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _environment()


def _walks_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template loops over a message's ``content`` (it expects a list of parts)."""
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const):
            if it.arg.value == "content":
                return True
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
    return False


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])  # an AddedToken written as a dict
    return None


def read_template(folder: Path) -> tuple[str | None, dict[str, str]]:
    """The template source of a model folder (None when it has none) and its special tokens."""
    cfg: dict[str, Any] = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot read {cfg_path}: {exc}") from None
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(cfg.get(key))
        if text is not None:
            special[key] = text
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(), special
    source = cfg.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    return (source if isinstance(source, str) and source else None), special


class ChatTemplate:
    """A compiled chat template with the special tokens it is rendered with.

    ``model`` names the model in error messages.
    """

    def __init__(
        self, source: str, special_tokens: Mapping[str, str] | None = None, model: str = ""
    ) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.model = model or "this model"
        try:
            ast = _ENV.parse(source)
            self._compiled = _ENV.from_string(ast)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InvalidArgument(
                f"the chat template of {self.model} does not compile: {exc.message} "
                f"(line {exc.lineno})"
            ) from None
        self.content_format = PARTS_CONTENT if _walks_content(ast) else STRING_CONTENT
        #: Whether the template renders ``tools`` itself (else a tool prompt is needed).
        self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate | None:
        """The template of a Hugging Face-format folder; None when the model has none."""
        source, special = read_template(folder)
        if source is None:
            return None
        return cls(source, special, model=folder.name)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``messages`` (OpenAI-style dicts; content a string or parts).

        Media parts become :data:`MEDIA_PLACEHOLDERS` inside the content, in place. A
        template that raises (``raise_exception``) or fails on the messages raises
        ``InvalidArgument`` with the template's message. ``continue_final_message`` ends
        the prompt right after the last message's text (its end-of-turn cut off), so that
        the model continues it, as transformers does; ``kwargs`` are more template
        variables (``chat_template_kwargs``).
        """
        if continue_final_message and add_generation_prompt:
            raise InvalidArgument(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "continue the last message, or start a new assistant turn"
            )
        chat = normalize_messages(messages, self.content_format)
        context = {**self.special_tokens, **kwargs}
        try:
            # tools and documents are always defined (None when absent), as in transformers:
            # templates test ``tools is not none``, which an undefined name would pass.
            text = self._compiled.render(
                messages=chat,
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None if documents is None else [dict(d) for d in documents],
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument(
                f"the chat template of {self.model} rejected the messages: {exc}"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidArgument(
                f"the chat template of {self.model} failed on the messages: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        return _cut_after_final(text, chat[-1]) if continue_final_message else text


def _cut_after_final(text: str, final: Mapping[str, Any]) -> str:
    """``text`` cut right after the last occurrence of ``final``'s text (its last text part).

    Templates often trim a message; then the cut is after the trimmed text, else after the
    text with its own trailing whitespace (transformers' rule).
    """
    content = final.get("content")
    if isinstance(content, Sequence) and not isinstance(content, str):
        texts = [p["text"] for p in content if isinstance(p, Mapping) and "text" in p]
        if not texts:
            raise InvalidArgument(
                "continue_final_message: the last message has no text to continue"
            )
        content = texts[-1]
    content = content if isinstance(content, str) else ""
    stripped = content.strip()
    if stripped not in text:
        raise InvalidArgument(
            "continue_final_message: the last message's text does not appear in the "
            "rendered prompt (the template changes it), so it cannot be continued"
        )
    at = text.rindex(stripped)
    kept = content.lstrip()
    if text[at : at + len(kept)] == kept:
        return text[: at + len(kept)]
    return text[: at + len(stripped)]


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message has an image or audio part (such a chat needs the worker's
    multimodal path: its ids depend on the encoder's output length)."""
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, Sequence) and not isinstance(content, str):
            if any(isinstance(p, Mapping) and media_kind(p) for p in content):
                return True
    return False


def media_kind(part: Mapping[str, Any]) -> str:
    """``image`` or ``audio`` for a media part, "" for anything else."""
    return _MEDIA_PART_TYPES.get(str(part.get("type", "")), "")


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], content_format: str = STRING_CONTENT
) -> list[dict[str, Any]]:
    """Fresh copies of ``messages`` as the template expects them.

    Content that is a list of parts is joined into one string (text parts as they are,
    media parts as their placeholder) unless ``content_format`` is ``openai``: then it
    stays a list, media parts becoming text parts holding the placeholder.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidArgument("messages is empty: send at least one message")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgument(
                f"messages[{i}] is {type(m).__name__}; a message is an object with role and content"
            )
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{i}].role is missing; set a role such as user")
        msg = dict(m)
        content = m.get("content")
        if isinstance(content, Sequence) and not isinstance(content, str):
            parts = [_part(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content)]
            if content_format == PARTS_CONTENT:
                msg["content"] = [{"type": "text", "text": t} for t in parts]
            else:
                msg["content"] = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise InvalidArgument(
                f"messages[{i}].content is {type(content).__name__}; accepted: a string or a "
                "list of parts"
            )
        out.append(msg)
    return out


def _part(part: Any, name: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise InvalidArgument(f"{name} is {type(part).__name__}; a part is an object with a type")
    kind = str(part.get("type", ""))
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidArgument(f"{name}.text is missing; a text part needs text")
        return text
    media = media_kind(part)
    if media:
        return MEDIA_PLACEHOLDERS[media]
    raise InvalidArgument(
        f"{name}.type {kind!r} is not accepted; accepted: text, {', '.join(_MEDIA_PART_TYPES)}"
    )
