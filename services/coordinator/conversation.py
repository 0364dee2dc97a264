"""Chat prompts with a history and media for llm generate calls, and media for encode calls.

An ``llm.generate`` node may take, besides its ``prompt`` (the new user turn), the optional
inputs ``messages`` (the conversation so far: ``{role, content}`` dicts, oldest first, the
content a string) and ``media`` (the ``items`` an ``encoder.encode`` node produced: each an
item id and the ``TensorRef`` of its embeddings). The worker gets them as chat messages and
renders its model's own template; the media become encoded content parts, so the worker
reads the embeddings from the data plane only where it must compute their span.

Where the media go: by default into the first user turn of the conversation (node param
``media_turn`` ``"first"``), so that a client that sends the same image with every turn
gets the same prompt prefix, and the later turns reuse the pages of the history and of the
media span; ``"last"`` puts them into the new turn (a spoken question in each turn).

No gRPC here besides the worker's message types.
"""

from __future__ import annotations

from typing import Any

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2
from omniflow.errors import InvalidArgument
from omniflow.operations import operation

MAX_MESSAGES = 256
MAX_MEDIA = 16
ROLES = ("system", "user", "assistant")
_GENERATE = operation("llm", "generate")
assert _GENERATE is not None
_KINDS = {"image": common_pb2.MediaItem.KIND_IMAGE, "audio": common_pb2.MediaItem.KIND_AUDIO}


def has_conversation(inputs: dict[str, Any]) -> bool:
    """Whether an llm generate call carries a history or media (so it is sent as messages)."""
    return bool(inputs.get("messages")) or bool(inputs.get("media"))


def _entries(
    raw: Any, name: str, limit: int, keys: tuple[str, str], *, accepted: str, unit: str
) -> list[tuple[Any, Any]]:
    """Input ``name``'s entries (a list of at most ``limit``; one entry alone where no
    ``accepted``) as their values at ``keys``, None where an entry is no dict or lacks one."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        if accepted:
            raise InvalidArgument(f"input {name!r} is {type(raw).__name__}; accepted: {accepted}")
        raw = [raw]
    if len(raw) > limit:
        raise InvalidArgument(f"input {name!r} has {len(raw)} {unit}; at most {limit}")
    return [(m.get(keys[0]), m.get(keys[1])) if isinstance(m, dict) else (None, None) for m in raw]


def _history(raw: Any) -> list[tuple[str, str]]:
    turns = _entries(
        raw,
        "messages",
        MAX_MESSAGES,
        ("role", "content"),
        accepted="a list of {role, content}",
        unit="entries",
    )
    for i, (role, content) in enumerate(turns):
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role is {role!r}; accepted: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise InvalidArgument(
                f"messages[{i}].content is {type(content).__name__}; accepted: a string"
            )
    return turns


def _encoded(raw: Any) -> list[worker_pb2.ContentPart]:
    items = _entries(raw, "media", MAX_MEDIA, ("item_id", "embeddings"), accepted="", unit="items")
    parts = []
    for i, (item_id, ref) in enumerate(items):
        if not isinstance(ref, common_pb2.TensorRef) or not isinstance(item_id, bytes):
            raise InvalidArgument(
                f"media[{i}] is not an encoded item; accepted: the items of an encoder.encode "
                "node ({item_id: bytes, embeddings: TensorRef})"
            )
        parts.append(
            worker_pb2.ContentPart(encoded=worker_pb2.EncodedItem(item_id=item_id, embeddings=ref))
        )
    return parts


def conversation(
    prompt: str, inputs: dict[str, Any], params: dict[str, Any]
) -> worker_pb2.ChatMessages:
    """The chat messages of a generate call: ``system`` param, history, the new user turn
    (``prompt``), with the media in the turn ``media_turn`` names."""
    system = _GENERATE.param(params, "system")
    where = _GENERATE.param(params, "media_turn")
    turns = _history(inputs.get("messages"))
    if system and not any(role == "system" for role, _ in turns):
        turns.insert(0, ("system", system))
    turns.append(("user", prompt))
    media = _encoded(inputs.get("media"))
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    at = users[0] if where == "first" else users[-1]
    out = worker_pb2.ChatMessages(add_generation_prompt=True)
    for i, (role, content) in enumerate(turns):
        msg = out.messages.add(role=role)
        if i == at:
            msg.content.extend(media)
        if content or i != at or not media:
            msg.content.add(text=content)
    return out


def encode_items(inputs: dict[str, Any]) -> list[common_pb2.MediaItem]:
    """The media of an encode call: ``media`` (media items), then ``image`` and ``audio``
    (a file's bytes each); absent inputs are skipped, at least one item is needed."""
    media = inputs.get("media")
    items: list[common_pb2.MediaItem] = []
    for i, m in enumerate(media if isinstance(media, list) else [media] if media else []):
        if isinstance(m, bytes):
            raise InvalidArgument(
                f"media[{i}] is bytes with no kind; send them as input 'image' or 'audio'"
            )
        if not isinstance(m, common_pb2.MediaItem):
            raise InvalidArgument(
                f"media[{i}] is {type(m).__name__}; accepted: a media item or a list of them"
            )
        items.append(m)
    for name, kind in _KINDS.items():
        data = inputs.get(name)
        if data is None:
            continue
        if not isinstance(data, bytes) or not data:
            raise InvalidArgument(
                f"input {name!r} is {type(data).__name__}; accepted: the {name} file's bytes"
            )
        items.append(common_pb2.MediaItem(kind=kind, data=data))
    if not items:
        raise InvalidArgument("encode needs media: set input 'media', 'image' or 'audio'")
    if len(items) > MAX_MEDIA:
        raise InvalidArgument(f"encode got {len(items)} media items; at most {MAX_MEDIA}")
    return items
