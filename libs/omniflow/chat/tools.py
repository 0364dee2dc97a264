"""Tool calls in chat: the tools a request offers, put before the model, and the calls
parsed out of what it writes.

A model whose chat template takes ``tools`` gets them from its template, as transformers'
``apply_chat_template(tools=...)`` renders them; the history's assistant ``tool_calls``
reach the template with their ``arguments`` as objects (what Hugging Face templates
expect) and ``tool`` messages as they are. A model whose template knows no tools gets
the tool prompt of its *tool format* instead (``TOOL_FORMATS``):

- ``hermes``: the tools as JSON inside ``<tools></tools>`` in the system message, the
  model asked to answer a call as ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``; earlier calls are written back the same way, tool results as a user
  turn of ``<tool_response>...</tool_response>`` blocks. Calls are parsed from those
  tags (what Qwen2.5's template and vLLM's ``hermes`` parser use).
- ``none``: the model takes no tools (a request with ``tools`` is refused).

``tool_choice`` ``required`` and a named function are not left to the parser: as vLLM
does, the answer is constrained by a JSON schema (the named function's ``parameters``;
for ``required`` an array of ``{"name", "parameters"}`` objects, one per call), so the
arguments always validate against the function's schema.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omniflow.errors import InvalidArgument

TOOL_FORMATS = ("hermes", "none")
DEFAULT_TOOL_FORMAT = "hermes"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

HERMES_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: its id, the function's name, the arguments as JSON text."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """A call id as OpenAI's look (``call_`` and 24 random hex digits)."""
    return "call_" + secrets.token_hex(12)


def tool_format_for(setting: str, model: str) -> str:
    """The tool format of ``model`` under a ``model=format,*=format`` setting (the entry
    for the model, else ``*``, else ``hermes``)."""
    table = parse_tool_formats(setting)
    return table.get(model, table.get("*", DEFAULT_TOOL_FORMAT))


def parse_tool_formats(setting: str) -> dict[str, str]:
    """``model=format`` pairs (comma-separated; ``*`` for every other model) as a dict;
    ValueError naming a bad entry."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in setting.split(",")):
        if not entry:
            continue
        model, sep, fmt = entry.partition("=")
        if not sep or not model.strip() or fmt.strip() not in TOOL_FORMATS:
            raise ValueError(
                f"tool format entry {entry!r}: write model=format with format one of "
                f"{', '.join(TOOL_FORMATS)} (* for every other model)"
            )
        out[model.strip()] = fmt.strip()
    return out


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function")
    return fn if isinstance(fn, Mapping) else {}


def parameters_of(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A function's ``parameters`` schema; a function without one takes any object."""
    params = function_of(tool).get("parameters")
    return dict(params) if isinstance(params, Mapping) and params else {"type": "object"}


def tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The ``hermes`` tool prompt: the tools and how to call them."""
    return HERMES_PROMPT.format(tools="\n".join(json.dumps(dict(t)) for t in tools))


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as templates read them: an object (JSON text parsed), else as is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _calls_for_template(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        c = dict(call)
        fn = dict(function_of(call))
        fn["arguments"] = _arguments_object(fn.get("arguments", {}))
        c["function"] = fn
        out.append(c)
    return out


def _call_text(call: Mapping[str, Any]) -> str:
    fn = function_of(call)
    body = {"name": fn.get("name", ""), "arguments": _arguments_object(fn.get("arguments", {}))}
    return f"{CALL_OPEN}\n{json.dumps(body)}\n{CALL_CLOSE}"


def template_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_takes_tools: bool,
) -> list[dict[str, Any]]:
    """``messages`` as the template renders them under the ``hermes`` format.

    A template that takes tools gets the calls' arguments as objects and everything else
    as is (``tools`` go to the template). One that does not gets the tool prompt in its
    system message (when ``tools`` are given), earlier calls as ``<tool_call>`` text and
    tool results as user turns of ``<tool_response>`` blocks.
    """
    if template_takes_tools:
        out = []
        for m in messages:
            msg = dict(m)
            if msg.get("tool_calls"):
                msg["tool_calls"] = _calls_for_template(msg["tool_calls"])
            out.append(msg)
        return out
    out = []
    for m in messages:
        msg = dict(m)
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            text = msg.get("content") or ""
            calls = "\n".join(_call_text(c) for c in msg.pop("tool_calls"))
            msg["content"] = f"{text}\n{calls}" if text else calls
        elif role == "tool":
            block = f"{RESPONSE_OPEN}\n{_text(msg.get('content'))}\n{RESPONSE_CLOSE}"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_results"):
                prev["content"] += "\n" + block  # consecutive results: one user turn
                continue
            msg = {"role": "user", "content": block, "_tool_results": True}
        out.append(msg)
    for msg in out:
        msg.pop("_tool_results", None)
    if tools:
        prompt = tool_prompt(tools)
        if out and out[0].get("role") == "system":
            system = _text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{system}\n\n{prompt}" if system else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
    return "".join(str(p) for p in parts)


# ------------------------------------------------------------------ tool_choice


def check_tools(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None
) -> str:
    """The effective tool choice (``none``, ``auto``, ``required`` or a function's name);
    InvalidArgument naming what is wrong (a choice without tools, an unknown function,
    a duplicate name)."""
    names = [function_of(t).get("name") for t in tools or ()]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"tools[{i}].function.name is missing")
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise InvalidArgument(f"tools: function names must be unique; repeated: {sorted(dup)}")
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "required") and not tools:
            raise InvalidArgument(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    name = function_of(tool_choice).get("name")
    if name not in names:
        raise InvalidArgument(
            f"tool_choice names function {name!r}, which is not among tools "
            f"({', '.join(map(str, names)) or 'none given'})"
        )
    return f"function:{name}"


def forced_schema(
    tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool = True
) -> dict[str, Any] | None:
    """The JSON schema an answer under ``choice`` must match, None when it is free text.

    A named function: its ``parameters`` (the answer is the arguments). ``required``: an
    array of calls ``{"name", "parameters"}`` of the offered functions, at least one (at
    most one when ``parallel`` is off).
    """
    if choice.startswith("function:"):
        name = choice.removeprefix("function:")
        tool = next(t for t in tools if function_of(t).get("name") == name)
        return parameters_of(tool)
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function_of(t)["name"]]},
                "parameters": parameters_of(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, choice: str) -> list[ToolCall]:
    """The calls of an answer constrained by :func:`forced_schema` (none when it is not
    JSON, e.g. cut short by max_tokens: the text is then the content)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if choice.startswith("function:"):
        return [ToolCall(new_call_id(), choice.removeprefix("function:"), json.dumps(value))]
    calls = []
    for item in value if isinstance(value, list) else []:
        if isinstance(item, Mapping) and isinstance(item.get("name"), str):
            args = json.dumps(item.get("parameters", {}))
            calls.append(ToolCall(new_call_id(), item["name"], args))
    return calls


# ------------------------------------------------------------------ parsing (hermes)


def _parse_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(
        new_call_id(), value["name"], args if isinstance(args, str) else json.dumps(args)
    )


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The content and the calls of a whole answer: ``<tool_call>`` blocks holding a JSON
    ``{"name", "arguments"}`` become calls, the text before the first one is the content.
    A block that does not parse stays in the content (nothing is lost)."""
    stream = CallStream()
    pieces = stream.feed(text) + stream.end()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    return content, calls


class CallStream:
    """The ``hermes`` parser over a streamed answer: text in, content pieces and whole
    calls out, in order.

    Text that may be the start of ``<tool_call>`` is held back until it is known; a call is
    handed out when its closing tag arrives (or, unclosed, at the end if its JSON parses).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE) :]
                self._in_call = False
                call = _parse_call(body)
                out.append(call if call is not None else CALL_OPEN + body + CALL_CLOSE)
                continue
            start = self._buf.find(CALL_OPEN)
            if start >= 0:
                if start:
                    out.append(self._buf[:start])
                self._buf = self._buf[start + len(CALL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_tag(self._buf)
            if len(self._buf) > keep:
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
            return out

    def end(self) -> list[str | ToolCall]:
        """What is left at the end: an unclosed call (if it parses) or text."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = _parse_call(rest)
            return [call] if call is not None else [CALL_OPEN + rest]
        return [rest] if rest else []


def _partial_tag(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
