"""KV routing hints for llm calls: the prompt's block hashes, for the router's kv_aware Pick.

The router stays cheap: it matches hashes against the KV index but never tokenizes. The
coordinator computes the hashes itself, exactly as the worker will: the llm workers of a
role register their ``model`` (a model folder) and ``kv_namespace`` (hex of the KV layout
fingerprint) in discovery; the coordinator loads ``tokenizer.json`` from that folder once
(the folder is readable on a single machine, and on the shared ``/models`` volume in
compose), tokenizes the prompt the way the worker does for a ``text`` prompt (the
tokenizer's ``encode``, no chat template), and hashes the full pages with
``omniflow.kv.blocks.block_hashes`` (page size 16, or the worker's ``page_size`` metadata).

When the hashes cannot be computed (no llm worker with a namespace, no readable
tokenizer, the ``tokenizers`` package missing) the Pick goes out without hints, so the
router picks by load; every outcome is counted (``counts`` and the Prometheus counter
``omniflow_coordinator_kv_hints_total{result}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from prometheus_client import Counter

from omniflow.kv.blocks import DEFAULT_PAGE_SIZE, block_hashes
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
ERROR = "fallback_error"

WORKERS_REFRESH_S = 2.0
TOKENIZER_RETRY_S = 30.0
CACHE_ENTRIES = 256
THREAD_CHARS = 8192  # longer prompts are tokenized off the event loop


@dataclass(frozen=True, slots=True)
class KVHints:
    """What a Pick carries for kv_aware: the namespace (hex), the prompt's block hashes."""

    namespace: str
    block_hashes: tuple[bytes, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class _Model:
    namespace: bytes
    page_size: int
    folder: str


class _Tokenizer:
    """A tokenizer.json loaded once, or the reason it could not be."""

    def __init__(self, tok: Any | None, error: str) -> None:
        self.tok, self.error, self.at = tok, error, time.monotonic()


def _load_tokenizer(folder: str) -> _Tokenizer:
    path = Path(folder) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer  # the worker extra; absent: no hints
    except ImportError:
        return _Tokenizer(None, "the tokenizers package is not installed")
    try:
        return _Tokenizer(Tokenizer.from_file(str(path)), "")
    except Exception as exc:  # missing, unreadable or malformed: no hints for this model
        return _Tokenizer(None, f"cannot read {path}: {exc}")


class KVHinter:
    """Block hashes of llm prompts, from the tokenizer of the role's model.

    ``workers`` lists the registered workers (discovery); it is asked at most every
    ``refresh_s`` and in the background once a listing exists.
    """

    def __init__(
        self,
        workers: Callable[[], Awaitable[list[WorkerRecord]]],
        *,
        refresh_s: float = WORKERS_REFRESH_S,
    ) -> None:
        self._list_workers = workers
        self.refresh_s = refresh_s
        self.counts: Tally[str] = Tally()
        self._workers: list[WorkerRecord] | None = None
        self._listed_at = 0.0
        self._refresh: asyncio.Task[None] | None = None
        self._tokenizers: dict[str, _Tokenizer] = {}
        self._loading: dict[str, asyncio.Future[_Tokenizer]] = {}
        self._cache: dict[bytes, KVHints] = {}

    async def hints(self, role: str, prompt: str) -> KVHints | None:
        """Hints for a ``text`` prompt to ``role``; None when there are none to give."""
        try:
            result, hints = await self._hints(role, prompt)
        except Exception as exc:  # hints are an optimisation: never fail the call for them
            log.warning("KV hints for role %s failed: %s", role, exc)
            result, hints = ERROR, None
        self.counts[result] += 1
        KV_HINTS.labels(result).inc()
        return hints

    async def _hints(self, role: str, prompt: str) -> tuple[str, KVHints | None]:
        model = self._model(role, await self._role_workers(role))
        if model is None:
            return NO_WORKERS, None
        key = xxhash.xxh3_128_digest(model.namespace + prompt.encode())
        cached = self._cache.get(key)
        if cached is not None:
            return (HINTED if cached.block_hashes else SHORT), cached
        tokenizer = await self._tokenizer(model.folder)
        if tokenizer.tok is None:
            return NO_TOKENIZER, None
        if len(prompt) > THREAD_CHARS:
            ids = await asyncio.to_thread(_encode, tokenizer.tok, prompt)
        else:
            ids = _encode(tokenizer.tok, prompt)
        hashes = tuple(block_hashes(model.namespace, ids, model.page_size))
        hints = KVHints(model.namespace.hex(), hashes, len(ids))
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
    def _model(role: str, workers: list[WorkerRecord]) -> _Model | None:
        """The namespace most of the role's workers serve (one Pick carries one)."""
        by_ns: dict[str, list[WorkerRecord]] = {}
        for w in workers:
            if w.kv_namespace and w.model:
                by_ns.setdefault(w.kv_namespace, []).append(w)
        if not by_ns:
            return None
        ns, members = max(sorted(by_ns.items()), key=lambda kv: len(kv[1]))
        first = members[0]
        page = int(first.metadata.get("page_size", "") or DEFAULT_PAGE_SIZE)
        return _Model(bytes.fromhex(ns), page, first.model)

    async def _tokenizer(self, folder: str) -> _Tokenizer:
        known = self._tokenizers.get(folder)
        if known is not None and (
            known.tok is not None or time.monotonic() - known.at < TOKENIZER_RETRY_S
        ):
            return known
        pending = self._loading.get(folder)
        if pending is None:
            # Reading a real tokenizer.json takes a while: off the event loop, once.
            pending = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, folder))
            self._loading[folder] = pending
        try:
            loaded = await asyncio.shield(pending)
        finally:
            if pending.done():
                self._loading.pop(folder, None)
        if loaded.tok is None and (known is None or known.error != loaded.error):
            log.warning("no KV hints for model %s: %s", folder, loaded.error)
        self._tokenizers[folder] = loaded
        return loaded

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text).ids)
