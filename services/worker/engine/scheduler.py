"""Continuous batching with chunked prefill, bounded by a token budget per step.

Every step the running requests go first (a decoding request costs one token, a request
still in prefill costs a chunk of what is left), then waiting requests are admitted in
arrival order while budget, sequence slots and pages last. When pages run out for a running
request, the newest running request is preempted: its pages are released (its full pages
stay in the prefix cache) and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from omniflow_services.worker.engine.config import EngineConfig
from omniflow_services.worker.engine.prefix_cache import PrefixCache
from omniflow_services.worker.engine.sampling import SamplingParams
from omniflow_services.worker.llm.types import unqueue

log = logging.getLogger(__name__)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class SeqState:
    """The engine's state of one request (internal; callers see ``RequestOutput``)."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int]
    extra_keys: dict[int, bytes]
    want_logits: bool
    generator: torch.Generator | None
    hashes: list[bytes] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    registered: int = 0
    status: SeqStatus = SeqStatus.WAITING
    matched_once: bool = False
    detok: Any = None
    embeds: tuple[Any, ...] = ()  # EmbedSpan, sorted by start
    want_kv: bool = False
    penalty: Any = None  # PenaltyState when the request uses a penalty
    uid: int = -1  # unique per request in this engine (keys the decode K/V copy)
    fetched: Any = None  # FetchedPages from the data plane, imported at admission
    grammar: Any = None  # GrammarState of a request with structured output

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: SeqState
    num_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the known tokens (a token is sampled)."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens)


class Scheduler:
    """Decides which requests compute how many tokens in the next step."""

    def __init__(
        self, cache: PrefixCache, config: EngineConfig, match_prefix: Callable[[SeqState], None]
    ) -> None:
        self.cache = cache
        #: The engine's: its page size and a step's bounds (tokens, sequences).
        self.config = config
        self._match_prefix = match_prefix
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.num_preemptions = 0

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def _pages_needed(self, seq: SeqState, n: int) -> int:
        total = -(-(seq.num_computed + n) // self.config.page_size)
        return max(0, total - len(seq.pages))

    def _grow(self, seq: SeqState, n: int) -> bool:
        need = self._pages_needed(seq, n)
        if need == 0:
            return True
        pages = self.cache.allocate(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _reset(self, seq: SeqState) -> None:
        self.cache.release(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.registered = 0

    def _preempt(self, seq: SeqState) -> None:
        self.running.remove(seq)
        self._reset(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.info("preempted request %s (pool full); it will be recomputed", seq.request_id)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = self.num_preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for an older one
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            out.append(ScheduledSeq(seq, n))
            budget -= n
        # After a preemption the pool is tight: admit nothing new this step (avoids thrashing).
        admit = self.num_preemptions == preempted
        max_seqs = self.config.max_num_seqs
        while admit and self.waiting and budget > 0 and len(self.running) < max_seqs:
            seq = self.waiting[0]
            if not seq.pages and seq.num_computed == 0:
                self._match_prefix(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._grow(seq, n):
                self._reset(seq)  # keep nothing pinned while it waits for capacity
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def remove(self, seq: SeqState) -> None:
        """Take a finished or aborted request out of the queues and release its pages."""
        unqueue(seq, self.running, self.waiting)
        self.cache.release(seq.pages)
        seq.pages = []
        seq.status = SeqStatus.FINISHED
