"""The echo engine's compute model: fake numbers, real scheduling (a TEST engine).

A step-driven engine in the manner of a continuous-batching LLM server, so that cache
locality and load cost time the way they do in a real one:

- one step serves one token to every request in decode and up to ``step_tokens`` prompt
  tokens of requests still in prefill (first come, first served, chunked);
- a step lasts ``step_us + decode_us * requests in decode + prefill_us * prompt tokens
  computed`` — a busy worker serves everyone slower, and a long prefill delays the
  tokens of every request batched with it;
- a request's first token comes at the end of the step that finishes its prefill;
- the prefix cache holds ``capacity`` blocks (full pages, keyed by the project's block
  hashes), evicted least recently used, the tail of a chain before its head (as vLLM
  frees a request's blocks in reverse and a radix cache evicts leaves first): a chain
  only counts from its first block, so an LRU that dropped heads first would keep
  tails nobody can reuse. A request reuses the leading blocks cached when
  it is admitted; its own blocks enter the cache as the prefill computes them, so a
  request arriving while an identical prefix is still being computed does not reuse it.

No gRPC here: the role (``echo.role``) feeds requests in and streams the tokens out;
``plan`` and ``apply`` are pure bookkeeping that the unit tests drive without sleeping.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from omniflow.kv.blocks import KVLayout
from omniflow_services.worker.llm.types import EngineLoad, unqueue

#: The echo engine's KV layout: prompt bytes are its tokens, 16 to a page.
ECHO_LAYOUT = KVLayout("echo-bytes", 1, 1, 1, "float32", 16)


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Costs of one engine step, in microseconds, and the batch limits."""

    prefill_us: float = 0.0  # per prompt token computed (not cached)
    decode_us: float = 0.0  # per request in decode
    step_us: float = 0.0  # fixed cost of a step (launch, sampling)
    step_tokens: int = 2048  # prefill budget of one step (chunked prefill)
    max_running: int = 256  # requests in the batch; later ones wait


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One request in the engine; ``tokens`` yields the index of each new token, then None."""

    prompt_len: int
    hashes: list[bytes]
    max_new: int
    rid: int = 0
    cached: int = 0  # prompt tokens reused from the cache at admission
    computed: int = 0  # prompt tokens done (cached ones included)
    produced: int = 0
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prompt_len


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes: prompt chunks ``(request, tokens)`` and decode requests."""

    prefill: tuple[tuple[EngineRequest, int], ...]
    decode: tuple[EngineRequest, ...]
    seconds: float


class PrefixCache:
    """Block hashes in least-recently-used order, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def _touch(self, chain: list[bytes]) -> None:
        for h in reversed(chain):  # the head ends most recent: tails go first
            self.blocks.move_to_end(h)

    def match(self, hashes: list[bytes]) -> int:
        """Leading blocks present; marks them used."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        self._touch(hashes[:n])
        return n

    def insert(self, chain: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Cache a request's leading ``chain`` of blocks; (newly stored, evicted)."""
        stored = []
        for h in chain:
            if h not in self.blocks:
                self.blocks[h] = None
                stored.append(h)
        self._touch(chain)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return stored, evicted

    def clear(self) -> None:
        self.blocks.clear()


# Called with (stored, evicted) block hashes, in order, each time the cache changed.
BlockListener = Callable[[list[bytes], list[bytes]], None]


class EchoEngine:
    """Continuous batching over a fake cost model; see the module docstring."""

    # The llm interface (``llm.role.LLMRole``): its KV layout, and no tokenizer (the echo
    # role turns prompts into bytes itself).
    layout = ECHO_LAYOUT
    tokenizer = None

    def __init__(
        self,
        model: ComputeModel,
        cache_blocks: int,
        page_size: int,
        on_blocks: BlockListener | None = None,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.cache = PrefixCache(cache_blocks)
        self.on_blocks = on_blocks
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        # Counters (tokens are prompt bytes for the echo worker).
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.computed_tokens = 0
        self.steps = 0
        self.busy_s = 0.0

    # -- requests
    def submit(self, prompt_len: int, hashes: list[bytes], max_new: int) -> EngineRequest:
        req = EngineRequest(max(prompt_len, 1), hashes, max(max_new, 1), rid=next(self._ids))
        self.waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: EngineRequest) -> None:
        unqueue(req, self.running, self.waiting)

    # -- one step, as bookkeeping
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.model.max_running:
            req = self.waiting.popleft()
            hit = self.cache.match(req.hashes) * self.page_size
            # A real engine recomputes at least the last prompt token to get logits.
            req.cached = min(hit, req.prompt_len - 1)
            req.computed = req.cached
            self.prompt_tokens += req.prompt_len
            self.hit_tokens += req.cached
            self.running.append(req)

    def plan(self) -> StepPlan | None:
        """Admit waiting requests and plan the next step; None when there is nothing to do."""
        self._admit()
        if not self.running:
            return None
        m = self.model
        decode = tuple(r for r in self.running if not r.in_prefill)
        budget = max(m.step_tokens - len(decode), 1)
        chunks = []
        for r in self.running:
            if budget <= 0:
                break
            if r.in_prefill:
                n = min(r.prompt_len - r.computed, budget)
                chunks.append((r, n))
                budget -= n
        tokens = sum(n for _, n in chunks)
        us = m.step_us + m.decode_us * len(decode) + m.prefill_us * tokens
        return StepPlan(tuple(chunks), decode, us / 1e6)

    def apply(self, plan: StepPlan) -> None:
        """Account a finished step: prompt progress, cached blocks, one token per request."""
        self.steps += 1
        self.busy_s += plan.seconds
        page = self.page_size
        emit = [r for r in plan.decode if r in self.running]
        for r, n in plan.prefill:
            if r not in self.running:
                continue  # cancelled during the step
            before = r.computed // page
            r.computed += n
            self.computed_tokens += n
            if r.computed // page > before:
                stored, evicted = self.cache.insert(r.hashes[: r.computed // page])
                if self.on_blocks is not None and (stored or evicted):
                    self.on_blocks(stored, evicted)
            if not r.in_prefill:
                emit.append(r)  # the first token ends the prefill
        for r in emit:
            r.produced += 1
            r.tokens.put_nowait(r.produced)
            if r.produced >= r.max_new:
                self.running.remove(r)
                r.tokens.put_nowait(None)

    def load(self) -> EngineLoad:
        """What the router weighs: the batch, the queue, and the cache's blocks as pages."""
        cache = self.cache
        return EngineLoad(
            running=len(self.running),
            waiting=len(self.waiting),
            free_pages=max(cache.capacity - len(cache), 0),
            total_pages=cache.capacity,
        )

    def clear_cache(self) -> None:
        """Drop every cached block (the worker tells the index itself)."""
        self.cache.clear()

    # -- the clock
    async def run(self) -> None:
        """Step while there is work, sleeping each step's time; runs until cancelled."""
        loop = asyncio.get_running_loop()
        end = loop.time()
        while True:
            plan = self.plan()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Steps end on a running clock: a late wake-up (a busy host) shortens the
            # next sleep instead of slowing the modelled engine down.
            end = max(end, loop.time() - 0.005) + plan.seconds
            await asyncio.sleep(max(end - loop.time(), 0.0))
            self.apply(plan)
