"""Template and tokenize once: a model folder's tokenizer, chat template and block identity.

Whoever receives a prompt (the gateway, the coordinator, or the worker itself when it is
called directly) turns it into token ids with a :class:`Preprocessor` and hashes the full
pages with the worker's KV namespace, so that the ids the router matches are the ids the
worker computes. Chat prompts are rendered with the model's own template and tokenized
without adding special tokens again (the template writes them), as
``apply_chat_template(tokenize=True)`` does; text prompts are tokenized with the
tokenizer's special tokens, as the Hugging Face tokenizer does by default.

Tokenizing a long prompt takes milliseconds: the ``a*`` variants run on a thread so that
an event loop never does it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omniflow.chat.template import ChatTemplate, read_template
from omniflow.chat.tools import template_messages
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import DEFAULT_PAGE_SIZE, block_hashes
from omniflow.security.kvsalt import salted_extra_keys

Messages = Sequence[Mapping[str, Any]]


def load_tokenizer(folder: Path) -> Any:
    """``tokenizer.json`` of a model folder (a ``tokenizers.Tokenizer``)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise InvalidArgument(
            f"model {folder.name} has no tokenizer.json in {folder}: text and chat prompts "
            "need one; send token_ids instead"
        )
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # malformed file: say which
        raise InvalidArgument(f"cannot read {path}: {exc}") from None


def read_eos_token_ids(folder: Path, tokenizer: Any | None = None) -> tuple[int, ...]:
    """Every end-of-sequence id: ``generation_config.json`` first, then ``config.json``,
    then the ``eos_token`` of ``tokenizer_config.json``."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and eos:
            return tuple(int(e) for e in eos)
    if tokenizer is not None:
        _, special = read_template(folder)
        tok = special.get("eos_token")
        if tok is not None and tokenizer.token_to_id(tok) is not None:
            return (int(tokenizer.token_to_id(tok)),)
    return ()


class Preprocessor:
    """Prompt → token ids → block hashes for one model folder and one KV namespace."""

    def __init__(
        self,
        folder: Path,
        tokenizer: Any,
        template: ChatTemplate | None,
        namespace: bytes,
        page_size: int = DEFAULT_PAGE_SIZE,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        if page_size <= 0:
            raise InvalidArgument(f"page_size must be > 0, got {page_size}")
        self.folder = folder
        self.model = folder.name
        self.tokenizer = tokenizer
        self.template = template
        self.namespace = namespace
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids
        self._affixes: tuple[list[int], list[int]] | None = None

    @classmethod
    def from_folder(
        cls,
        folder: Path,
        namespace: bytes,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        tokenizer: Any | None = None,
    ) -> Preprocessor:
        """Read ``folder``'s tokenizer (unless one already loaded is given) and template."""
        folder = Path(folder)
        tok = tokenizer if tokenizer is not None else load_tokenizer(folder)
        return cls(
            folder,
            tok,
            ChatTemplate.from_folder(folder),
            namespace,
            page_size,
            read_eos_token_ids(folder, tok),
        )

    @property
    def has_template(self) -> bool:
        return self.template is not None

    def require_template(self) -> ChatTemplate:
        """The chat template; InvalidArgument naming the model when it has none."""
        if self.template is None:
            raise InvalidArgument(
                f"model {self.model} has no chat template (no chat_template.jinja and no "
                "chat_template in tokenizer_config.json): send a text prompt or token_ids "
                "instead of messages"
            )
        return self.template

    def render_chat(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages`` under the model's template (media as placeholders).

        ``tools`` (OpenAI's function tools) and the history's tool calls and results are
        rendered by the template when it takes tools, else through the tool prompt
        (``omniflow.chat.tools``). ``template_kwargs`` are more template variables.
        """
        template = self.require_template()
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages = template_messages(messages, tools, template.takes_tools)
            if not template.takes_tools:
                tools = None
        return template.render(
            messages,
            add_generation_prompt,
            tools=tools or None,
            continue_final_message=continue_final_message,
            **dict(template_kwargs or {}),
        )

    def encode_piece(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens added (a part of a rendered prompt)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_chat(
        self, messages: Messages, add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        """Rendered with the template (``options``: those of :meth:`render_chat`), then
        tokenized without adding special tokens again.

        For text chats: a media part's placeholder would be tokenized as text here, while
        the worker puts the encoder's embeddings there (check ``has_media`` first and send
        such a chat as messages).
        """
        return self.encode_piece(self.render_chat(messages, add_generation_prompt, **options))

    def encode_text(self, text: str) -> list[int]:
        """Ids of a completion prompt, special tokens added as the tokenizer's default."""
        return list(self.tokenizer.encode(text).ids)

    def text_affixes(self) -> tuple[list[int], list[int]]:
        """The special ids ``encode_text`` puts before and after a text (e.g. Llama's BOS),
        for a text prompt tokenized in pieces (around media items)."""
        if self._affixes is None:
            enc = self.tokenizer.encode("a")
            mask = list(enc.special_tokens_mask)
            ids = list(enc.ids)
            body = [i for i, m in enumerate(mask) if not m]
            if not body:
                self._affixes = ([], [])
            else:
                self._affixes = (ids[: body[0]], ids[body[-1] + 1 :])
        return self._affixes

    def block_hashes(
        self, ids: Sequence[int], extra_keys: Mapping[int, bytes] | None = None
    ) -> list[bytes]:
        """The full pages' hashes under this namespace (DESIGN §4.1), salted with the tenant
        of the call being served, as the worker salts them (``omniflow.security.kvsalt``)."""
        salted = salted_extra_keys(dict(extra_keys) if extra_keys else None)
        return block_hashes(self.namespace, ids, self.page_size, salted)

    async def aencode_chat(
        self, messages: Messages, add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        return await asyncio.to_thread(
            functools.partial(self.encode_chat, messages, add_generation_prompt, **options)
        )

    async def aencode_text(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.encode_text, text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


CACHE_ENTRIES = 16
_cache: OrderedDict[tuple[str, bytes, int], Preprocessor] = OrderedDict()
_cache_lock = threading.Lock()


def cached_preprocessor(
    folder: Path | str, namespace: bytes, page_size: int = DEFAULT_PAGE_SIZE
) -> Preprocessor:
    """A shared Preprocessor per (folder, namespace, page size); loads it on first use."""
    key = (str(Path(folder).expanduser().resolve()), namespace, page_size)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    pre = Preprocessor.from_folder(Path(key[0]), namespace, page_size)
    with _cache_lock:
        _cache[key] = pre
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return pre


async def acached_preprocessor(
    folder: Path | str, namespace: bytes, page_size: int = DEFAULT_PAGE_SIZE
) -> Preprocessor:
    """:func:`cached_preprocessor` off the event loop (reading tokenizer.json takes a while)."""
    return await asyncio.to_thread(cached_preprocessor, folder, namespace, page_size)
