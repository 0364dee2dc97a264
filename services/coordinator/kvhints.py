"""KV routing hints and prompt ids for llm calls: template and tokenize once, here.

The router stays cheap: it matches hashes against the KV index but never tokenizes. The
coordinator turns the prompt into token ids itself, exactly as the worker would: the llm
workers of a role register their ``model`` (a model folder) and ``kv_namespace`` (hex of
the KV layout fingerprint) in discovery; the coordinator loads that folder's tokenizer and
chat template once (``omniflow.chat.Preprocessor``, the implementation the workers and the
gateway use; the folder is readable on a single machine, and on the shared ``/models``
volume in compose). A ``text`` prompt is tokenized with the tokenizer's special tokens; a
chat prompt (node param ``chat``) is one user message, after an optional ``system`` one,
rendered with the model's own template. The full pages are hashed with
``omniflow.kv.blocks.block_hashes`` (page size 16, or the worker's ``page_size``
metadata). The same ids then go to the worker as ``token_ids`` when it serves that
namespace, so the pages the router matched are the pages the worker computes, and the
worker does not tokenize again.

When the ids cannot be computed (no llm worker with a namespace, no readable tokenizer)
the Pick goes out without hints, so the router picks by load, and the worker gets the
prompt itself; every outcome is counted (``counts`` and the Prometheus counter
``omniflow_coordinator_kv_hints_total{result}``). Tokenizing runs on a thread, never on
the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import xxhash
from prometheus_client import Counter

from omniflow.chat import Preprocessor, acached_preprocessor
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import DEFAULT_PAGE_SIZE, check_hashes
from omniflow.kv.wire import parse_namespace
from omniflow.prompt_size import text_bytes
from omniflow.security.kvsalt import kv_salt
from omniflow.security.policy import caller_tenant
from omniflow.workers import WorkerRecord

log = logging.getLogger(__name__)

KV_HINTS = Counter(
    "omniflow_coordinator_kv_hints_total",
    "Picks of llm generate calls, by whether KV hints went with them and why not",
    ["result"],
)

# Outcomes (also the keys of KVHinter.counts).
HINTED = "hinted"
SHORT = "short_prompt"  # fewer tokens than one page: nothing to match
NO_WORKERS = "fallback_no_namespace"
NO_TOKENIZER = "fallback_no_tokenizer"
NO_TEMPLATE = "fallback_no_template"  # a chat prompt to a model without a chat template
ERROR = "fallback_error"
TOO_LARGE = "fallback_too_large"  # past max_prompt_bytes: not templated or tokenized here

WORKERS_REFRESH_S = 2.0
TOKENIZER_RETRY_S = 30.0
CACHE_ENTRIES = 256


@dataclass(frozen=True, slots=True)
class KVHints:
    """What a Pick carries for kv_aware: the namespace (16 bytes), the prompt's block hashes;
    and the prompt's ids, which the worker of that namespace gets instead of the prompt."""

    namespace: bytes
    block_hashes: tuple[bytes, ...]
    prompt_tokens: int
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Prompt:
    """An llm prompt as a workflow node gives it: text, or one chat turn when ``chat``."""

    text: str
    chat: bool = False
    system: str = ""

    def messages(self) -> list[dict[str, Any]]:
        turns = [{"role": "system", "content": self.system}] if self.system else []
        return [*turns, {"role": "user", "content": self.text}]

    def key(self) -> bytes:
        if not self.chat:
            return b"t" + self.text.encode()
        return b"c" + xxhash.xxh3_128_digest(self.system.encode()) + self.text.encode()


@dataclass(frozen=True, slots=True)
class _Model:
    namespace: bytes
    page_size: int
    folder: str


class _Loaded:
    """A model folder's Preprocessor loaded once, or the reason it could not be."""

    def __init__(self, prep: Preprocessor | None, error: str) -> None:
        self.prep, self.error, self.at = prep, error, time.monotonic()


async def _load(model: _Model) -> _Loaded:
    try:
        return _Loaded(
            await acached_preprocessor(model.folder, model.namespace, model.page_size), ""
        )
    except Exception as exc:  # missing, unreadable or malformed: no hints for this model
        return _Loaded(None, str(exc))


class KVHinter:
    """Token ids and block hashes of llm prompts, from the tokenizer and chat template of
    the role's model.

    ``workers`` lists the registered workers (discovery); it is asked at most every
    ``refresh_s`` and in the background once a listing exists.
    """

    def __init__(
        self,
        workers: Callable[[], Awaitable[list[WorkerRecord]]],
        *,
        refresh_s: float = WORKERS_REFRESH_S,
        max_prompt_bytes: int = 1 << 20,
    ) -> None:
        self._list_workers = workers
        self.refresh_s = refresh_s
        #: A prompt past this is never templated or tokenized here: the call carries the
        #: prompt itself, and the worker refuses it by its own bound.
        self.max_prompt_bytes = max_prompt_bytes
        self.counts: Tally[str] = Tally()
        self._workers: list[WorkerRecord] | None = None
        self._listed_at = 0.0
        self._refresh: asyncio.Task[None] | None = None
        self._loaded: dict[_Model, _Loaded] = {}
        self._loading: dict[_Model, asyncio.Future[_Loaded]] = {}
        self._cache: dict[bytes, KVHints] = {}

    async def hints(self, role: str, prompt: str | Prompt) -> KVHints | None:
        """Hints for a prompt to ``role`` (a ``text`` prompt when given a str); None when
        there are none to give. Counted."""
        p = prompt if isinstance(prompt, Prompt) else Prompt(prompt)
        try:
            result, hints = await self._hints(role, p, "")
        except Exception as exc:  # hints are an optimisation: never fail the call for them
            log.warning("KV hints for role %s failed: %s", role, exc)
            result, hints = ERROR, None
        self.counts[result] += 1
        KV_HINTS.labels(result).inc()
        return hints

    async def prepared(self, role: str, prompt: Prompt, namespace: bytes) -> KVHints | None:
        """The prompt's ids for a worker of ``role`` serving ``namespace``; None when
        they cannot be computed here (the worker then gets the prompt itself). Not counted:
        the Pick of the same call was. The same ids as the Pick's hints (one cache)."""
        if not namespace:
            return None
        try:
            _, hints = await self._hints(role, prompt, namespace)
        except Exception as exc:
            log.warning("prompt ids for role %s failed: %s", role, exc)
            return None
        return hints

    async def _hints(
        self, role: str, prompt: Prompt, namespace: bytes
    ) -> tuple[str, KVHints | None]:
        if text_bytes(prompt.text) + text_bytes(prompt.system) > self.max_prompt_bytes:
            return TOO_LARGE, None
        model = self._model(role, await self._role_workers(role), namespace)
        if model is None:
            return NO_WORKERS, None
        # Per tenant: its hashes carry its salt (omniflow.security.kvsalt).
        key = xxhash.xxh3_128_digest(model.namespace + kv_salt(caller_tenant()) + prompt.key())
        cached = self._cache.get(key)
        if cached is not None:
            return (HINTED if cached.block_hashes else SHORT), cached
        loaded = await self._preprocessor(model)
        if loaded.prep is None:
            return NO_TOKENIZER, None
        pre = loaded.prep
        if prompt.chat and not pre.has_template:
            return NO_TEMPLATE, None  # the worker answers the call with INVALID_ARGUMENT
        if prompt.chat:
            ids = await pre.aencode_chat(prompt.messages())
        else:
            ids = await pre.aencode_text(prompt.text)
        hashes = tuple(pre.block_hashes(ids))
        hints = KVHints(model.namespace, hashes, len(ids), tuple(ids))
        if len(self._cache) >= CACHE_ENTRIES:
            del self._cache[next(iter(self._cache))]
        self._cache[key] = hints
        return (HINTED if hashes else SHORT), hints

    # -- the role's model
    async def _role_workers(self, role: str) -> list[WorkerRecord]:
        now = time.monotonic()
        if self._workers is None:
            await self._relist()
        elif now - self._listed_at > self.refresh_s and (
            self._refresh is None or self._refresh.done()
        ):
            self._refresh = asyncio.create_task(self._relist())  # serve the last listing
        return [w for w in self._workers or () if w.role == role]

    async def _relist(self) -> None:
        try:
            self._workers = await self._list_workers()
        except Exception as exc:
            log.warning("listing workers for KV hints failed: %s", exc)
            self._workers = self._workers or []
        self._listed_at = time.monotonic()

    @staticmethod
    def _model(role: str, workers: list[WorkerRecord], namespace: bytes = b"") -> _Model | None:
        """The model of ``namespace``, or the namespace most of the role's workers serve
        (one Pick carries one)."""
        by_ns: dict[bytes, list[WorkerRecord]] = {}
        for w in workers:
            if w.namespace_id and w.model:
                by_ns.setdefault(w.namespace_id, []).append(w)
        if namespace:
            members = by_ns.get(namespace)
            if not members:
                return None
            ns = namespace
        elif by_ns:
            ns, members = max(sorted(by_ns.items()), key=lambda kv: len(kv[1]))
        else:
            return None
        first = members[0]
        page = int(first.metadata.get("page_size", "") or DEFAULT_PAGE_SIZE)
        return _Model(ns, page, first.model)

    async def _preprocessor(self, model: _Model) -> _Loaded:
        known = self._loaded.get(model)
        if known is not None and (
            known.prep is not None or time.monotonic() - known.at < TOKENIZER_RETRY_S
        ):
            return known
        pending = self._loading.get(model)
        if pending is None:
            # Reading a real tokenizer.json takes a while: off the event loop, once.
            pending = asyncio.ensure_future(_load(model))
            self._loading[model] = pending
        try:
            loaded = await asyncio.shield(pending)
        finally:
            if pending.done():
                self._loading.pop(model, None)
        if loaded.prep is None and (known is None or known.error != loaded.error):
            log.warning("no KV hints for model %s: %s", model.folder, loaded.error)
        self._loaded[model] = loaded
        return loaded

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()


# -- hints of a call whose prompt is already paged (diffusion over an llm's prefill_only)
PAGES = "from_pages"  # outcome: the producing call's own block hashes


def pages_hints(pages: Any) -> KVHints | None:
    """Hints from the ``pages`` value of an llm ``prefill_only`` call ({kv_namespace,
    block_hashes, token_ids}): the producing worker's own hashes, so nothing is tokenized
    and the Pick matches exactly the pages that were stored. None (and not counted) when
    ``pages`` is not such a value; the call then fails at the worker, naming the field."""
    if not isinstance(pages, dict):
        return None
    ns, hashes, ids = pages.get("kv_namespace"), pages.get("block_hashes"), pages.get("token_ids")
    if not isinstance(ns, str) or not ns or not isinstance(hashes, list | tuple):
        return None
    try:
        namespace = parse_namespace(ns)  # the workflow value keeps the hex a person reads
    except InvalidArgument:
        return None  # the worker refuses it, naming the field
    if not all(isinstance(h, bytes) for h in hashes):
        return None
    try:
        check_hashes(hashes)
    except InvalidArgument:
        return None  # not 16-byte hashes: the worker refuses them, naming the field
    tokens = tuple(int(i) for i in ids) if isinstance(ids, list | tuple) else ()
    KV_HINTS.labels(PAGES).inc()
    return KVHints(namespace, tuple(hashes), len(tokens), tokens)
