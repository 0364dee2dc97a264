"""A prompt's size, measured the same way at every hop before anything templates or
tokenizes it: text as its UTF-8 bytes, chat messages as the bytes of their text, token ids
as 4 bytes each (their size as u32 on the wire). The gateway, the coordinator and the
worker each refuse a prompt past their bound (a setting, named in the error) before doing
any work on it: tokenizing 15 MiB took 8.6 s and 1 GB, and stalled everyone else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omniflow.errors import InvalidArgument

TOKEN_ID_BYTES = 4


def text_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def ids_bytes(ids: Sequence[int]) -> int:
    return TOKEN_ID_BYTES * len(ids)


def content_bytes(content: Any) -> int:
    """The text of one chat message's content: a string, or OpenAI's list of parts (the
    text parts count; media is bounded by the body size and each role's own limits)."""
    if isinstance(content, str):
        return text_bytes(content)
    if isinstance(content, Iterable) and not isinstance(content, (bytes, Mapping)):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += text_bytes(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += text_bytes(part["text"])
        return total
    return 0


def messages_bytes(messages: Iterable[Mapping[str, Any]]) -> int:
    return sum(content_bytes(m.get("content")) for m in messages)


def check_prompt_size(size: int, most: int, setting: str, what: str = "the prompt") -> None:
    """InvalidArgument when ``size`` (bytes, as measured here) is past ``most``."""
    if size > most:
        raise InvalidArgument(
            f"{what} is {size} bytes (text as UTF-8, token ids as 4 bytes each), more than "
            f"the largest accepted, {most} (raise it with {setting})"
        )
