"""The pick policy's worker table: live workers per role, their load and health, and the
strategies (the router's Pick and the gateway's in-process pick both run it).

Fed by discovery and by outcomes; no gRPC here. Load per worker is the larger of the
calls its owner knows are outstanding on it (picks not yet reported, calls in flight)
and the queue the worker last reported through ``GetLoad``.

``kv_aware``: the cost of a worker estimates, in prompt blocks of prefill, how long the
request would wait for its first token there: the prefill it would still have to do
(prompt blocks minus the blocks it can reach, credited 1.0 in its own device pool, 0.75
in its node's host tier — or in the device pool of another worker of its node, which
writes them through to that tier — and 0.25 on its node's SSD), plus the prefill the
picker already queued on that worker (the uncached blocks of its outstanding kv_aware
picks), plus ``load_weight`` blocks per outstanding request (its share of every step
while it decodes). Both load terms are in the same unit as the prefill, so a long prompt
is not swamped by a count of requests, nor a count of requests by a long prompt. With a
temperature above 0 the pick samples from ``softmax(-cost / temperature)``, spreading
load among near-equal workers.

Blocks only another node holds (its agent, or a worker there) are pulled over the link
instead of prefilled, when that is faster: each such block beyond what the worker reaches
on its own node is credited ``pull_credit`` = 1 - (its transfer time over the worker's
link) / (its prefill time at the worker's prefill speed), and 0 — a recompute — when the
transfer takes longer or no link speed is known (docs/control-flow.md).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash

from omniflow.errors import InvalidArgument, NotFound
from omniflow.kv.index_store import OwnerMatch
from omniflow.workers import WorkerRecord

STRATEGIES = (
    "round_robin",
    "random",
    "least_outstanding",
    "power_of_two",
    "consistent_hash",
    "weighted",
    "kv_aware",
)

# Credit per reachable block by where it sits (the cost model).
CREDIT_DEVICE, CREDIT_HOST, CREDIT_SSD = 1.0, 0.75, 0.25
VNODES = 64
# Codes that say nothing about a worker's health (the caller's fault, or a cancel): a
# client sending an unknown operation or a call it may not make must not open the
# breakers of healthy workers.
NEUTRAL_CODES = frozenset(
    {
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "CANCELLED",
        "FAILED_PRECONDITION",
        "ALREADY_EXISTS",
        "UNIMPLEMENTED",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "OUT_OF_RANGE",
    }
)


def pull_credit(
    page_bytes: int, page_tokens: int, link_gbps: float, prefill_tokens_s: float
) -> float:
    """Credit of one block pulled from another node rather than prefilled: the share of
    its prefill time the pull saves; 0 when the pull is slower or a figure is unknown."""
    if page_bytes <= 0 or page_tokens <= 0 or link_gbps <= 0 or prefill_tokens_s <= 0:
        return 0.0
    transfer_s = page_bytes * 8 / (link_gbps * 1e9)
    recompute_s = page_tokens / prefill_tokens_s
    return max(0.0, 1.0 - transfer_s / recompute_s)


def _metadata_float(record: WorkerRecord, key: str) -> float | None:
    raw = record.metadata.get(key, "")
    try:
        value = float(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 and math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class PickResult:
    worker: WorkerRecord
    strategy: str
    reachable_blocks: int = 0
    cost: float = 0.0
    fallback_reason: str = ""
    #: kv_aware: blocks the worker must prefill for this call; pass it to ``begin``.
    prefill_blocks: float = 0.0


class CircuitBreaker:
    """Closed → (``threshold`` failures in a row) → open for ``cooldown_s`` → half-open
    (one trial call) → closed on success, open again on failure."""

    __slots__ = ("cooldown_s", "failures", "opened_at", "state", "threshold", "trial_out")

    def __init__(self, threshold: int, cooldown_s: float) -> None:
        self.threshold, self.cooldown_s = threshold, cooldown_s
        self.failures = 0
        self.state = "closed"
        self.opened_at = 0.0
        self.trial_out = False

    def allows(self, now: float) -> bool:
        if self.state == "open" and now - self.opened_at >= self.cooldown_s:
            self.state, self.trial_out = "half_open", False
        if self.state == "half_open":
            return not self.trial_out
        return self.state == "closed"

    def on_pick(self) -> None:
        if self.state == "half_open":
            self.trial_out = True

    def record(self, success: bool, now: float) -> bool:
        """Returns True when this outcome opened the breaker."""
        if success:
            self.failures, self.state = 0, "closed"
            return False
        self.failures += 1
        if self.state == "half_open" or self.failures >= self.threshold:
            opened = self.state != "open"
            self.state, self.opened_at, self.trial_out = "open", now, False
            return opened
        return False


@dataclass(slots=True)
class _Live:
    record: WorkerRecord
    weight: float
    outstanding: dict[int, float] = field(default_factory=dict)  # ticket -> pick time
    queued: dict[int, float] = field(default_factory=dict)  # ticket -> prefill blocks
    reported_queue: int = 0
    healthy: bool = True
    breaker: CircuitBreaker | None = None
    current: float = 0.0  # smooth weighted round robin state
    # Discovery metadata: the worker's node link (Gbit/s), prefill speed (tokens/s) and
    # its KV page (bytes, tokens); ``pull`` is the credit per pulled block they give.
    link_gbps: float | None = None
    prefill_tokens_s: float | None = None
    page: tuple[int, int] = (0, 0)
    pull: float = 0.0


class WorkerTable:
    """Live workers by id, replaced wholesale on every discovery change."""

    def __init__(
        self,
        seed: int | None = None,
        *,
        breaker_threshold: int = 3,
        breaker_cooldown_s: float = 2.0,
        outstanding_ttl_s: float = 60.0,
        link_gbps: float = 0.0,
        prefill_tokens_s: float = 0.0,
    ) -> None:
        self._workers: dict[str, _Live] = {}
        self._cursor: dict[str, itertools.count[int]] = {}
        self._rng = random.Random(seed)
        self._rings: dict[str, tuple[list[int], list[str]]] = {}
        # Per role, its workers sorted by id: built once per discovery change, not per pick.
        self._by_role: dict[str, list[_Live]] = {}
        self._tickets = itertools.count(1)
        self.breaker_threshold, self.breaker_cooldown_s = breaker_threshold, breaker_cooldown_s
        self.outstanding_ttl_s = outstanding_ttl_s
        # Defaults for workers whose metadata names no link_gbps / prefill_tokens_s.
        self.link_gbps, self.prefill_tokens_s = link_gbps, prefill_tokens_s
        self.counters: dict[str, int] = {}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # -- membership
    def replace(self, workers: Iterable[WorkerRecord]) -> None:
        fresh: dict[str, _Live] = {}
        for w in workers:
            old = self._workers.get(w.worker_id)
            try:
                weight = max(float(w.metadata.get("weight", "1") or 1), 0.0)
            except ValueError:
                weight = 1.0
            live = _Live(
                w,
                weight,
                breaker=CircuitBreaker(self.breaker_threshold, self.breaker_cooldown_s),
                link_gbps=_metadata_float(w, "link_gbps"),
                prefill_tokens_s=_metadata_float(w, "prefill_tokens_s"),
                page=(
                    int(_metadata_float(w, "page_bytes") or 0),
                    int(_metadata_float(w, "page_size") or 0),
                ),
            )
            live.pull = self.pull_credit(live)
            if old is not None and old.record.address == w.address:
                live.outstanding, live.breaker = old.outstanding, old.breaker
                live.queued = old.queued
                live.reported_queue, live.healthy = old.reported_queue, old.healthy
            fresh[w.worker_id] = live
        self._workers = fresh
        self._rings.clear()
        by_role: dict[str, list[_Live]] = {}
        for live in sorted(fresh.values(), key=lambda v: v.record.worker_id):
            by_role.setdefault(live.record.role, []).append(live)
        self._by_role = by_role

    def list(self, role: str = "") -> list[WorkerRecord]:
        found = [v.record for v in self._workers.values() if not role or v.record.role == role]
        return sorted(found, key=lambda w: w.worker_id)

    def roles(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for v in self._workers.values():
            counts[v.record.role] = counts.get(v.record.role, 0) + 1
        return counts

    def breakers(self) -> dict[str, str]:
        now = time.monotonic()
        out = {}
        for wid, v in self._workers.items():
            assert v.breaker is not None
            v.breaker.allows(now)  # moves open → half_open when the cooldown passed
            out[wid] = v.breaker.state
        return out

    # -- load and outcomes
    def set_health(self, worker_id: str, healthy: bool, queue: int = 0) -> None:
        live = self._workers.get(worker_id)
        if live is not None:
            live.healthy, live.reported_queue = healthy, queue

    def load(self, worker_id: str) -> int:
        live = self._workers.get(worker_id)
        if live is None:
            return 0
        return self._load(live, time.monotonic() - self.outstanding_ttl_s)

    @staticmethod
    def _load(live: _Live, cutoff: float) -> int:
        outstanding = live.outstanding
        # Tickets go in in time order, so the first is the oldest: one look says whether
        # any pick was never reported (a caller that died) and should stop counting.
        if outstanding and next(iter(outstanding.values())) < cutoff:
            for ticket in [t for t, at in outstanding.items() if at < cutoff]:
                del outstanding[ticket]
                live.queued.pop(ticket, None)
        return max(len(outstanding), live.reported_queue)

    def queued_blocks(self, worker_id: str) -> float:
        """Prefill blocks of the calls outstanding on the worker (as estimated at pick)."""
        live = self._workers.get(worker_id)
        if live is None or not live.queued:
            return 0.0
        self.load(worker_id)  # drops expired tickets
        return sum(live.queued.values())

    def begin(self, worker_id: str, prefill_blocks: float = 0.0) -> int:
        """Count a call as outstanding on the worker; returns a ticket for ``finish``.

        ``prefill_blocks``: the prefill the call brings (``PickResult.prefill_blocks``),
        queued work that kv_aware weighs until the call finishes.
        """
        ticket = next(self._tickets)
        live = self._workers.get(worker_id)
        if live is not None:
            live.outstanding[ticket] = time.monotonic()
            if prefill_blocks > 0:
                live.queued[ticket] = prefill_blocks
        return ticket

    def finish(self, worker_id: str, ticket: int | None, success: bool, code: str = "") -> None:
        """An outcome: ends one outstanding call (``ticket``, or the oldest) and feeds the
        worker's breaker (errors that are the caller's fault do not count)."""
        live = self._workers.get(worker_id)
        if live is None:
            return
        if ticket is None and live.outstanding:
            ticket = min(live.outstanding)  # no ticket: the oldest call is the likeliest done
        if ticket is not None:
            live.outstanding.pop(ticket, None)
            live.queued.pop(ticket, None)
        assert live.breaker is not None
        if not success and code in NEUTRAL_CODES:
            # Says nothing about the worker (e.g. a pick made ahead and never used); a
            # half-open breaker's trial that never ran lets the next pick be the trial.
            live.breaker.trial_out = False
            return
        if live.breaker.record(success, time.monotonic()):
            self.count("breaker_opened")

    # -- picking
    def candidates(
        self, role: str, exclude: Iterable[str] = (), operation: str = ""
    ) -> list[_Live]:
        if not role:
            raise InvalidArgument("role is required (e.g. 'llm', 'encoder', 'diffusion')")
        excluded = set(exclude)
        now = time.monotonic()
        found = self._by_role.get(role, [])
        if excluded or operation:
            found = [
                v
                for v in found
                if v.record.worker_id not in excluded
                and (not operation or not v.record.operations or operation in v.record.operations)
            ]
        if not found:
            live = ", ".join(sorted(self.roles())) or "none"
            what = f" serving {operation!r}" if operation else ""
            raise NotFound(f"no live worker of role {role!r}{what}; live roles: {live}")
        healthy = [v for v in found if v.healthy]
        allowed = [
            v
            for v in healthy
            if v.breaker is None or v.breaker.state == "closed" or v.breaker.allows(now)
        ]
        if not allowed:
            # Every breaker is open: try the least recently failed rather than refuse.
            self.count("all_breakers_open")
            return healthy or list(found)
        return allowed

    def pick(
        self,
        role: str,
        strategy: str,
        exclude: Iterable[str] = (),
        operation: str = "",
        *,
        session_key: str = "",
        reach: list[OwnerMatch] | None = None,
        prompt_blocks: int = 0,
        temperature: float = 0.0,
        load_weight: float = 1.0,
        fallback_reason: str = "",
        page: tuple[int, int] = (0, 0),
        cands: list[_Live] | None = None,
    ) -> PickResult:
        """One worker of ``role`` by ``strategy``; raises NotFound when none is live.

        For ``kv_aware``, ``reach`` is the index's answer (None: it did not answer, so
        the pick is by load only) and ``page`` the namespace's (bytes, tokens) per block,
        which prices a pull from another node ((0, 0): unknown, never pulled). ``cands``:
        ``candidates(role, exclude, operation)`` when the caller already took them.
        """
        if strategy not in STRATEGIES:
            raise InvalidArgument(
                f"unknown strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}"
            )
        if cands is None:
            cands = self.candidates(role, exclude, operation)
        self.count(f"pick_{strategy}")
        if strategy == "kv_aware":
            result = self._kv_aware(cands, reach, prompt_blocks, temperature, load_weight, page)
        else:
            result = self._choose(role, strategy, cands, session_key)
        if fallback_reason:
            result = PickResult(
                result.worker,
                result.strategy,
                result.reachable_blocks,
                result.cost,
                fallback_reason,
                result.prefill_blocks,
            )
        live = self._workers[result.worker.worker_id]
        assert live.breaker is not None
        live.breaker.on_pick()
        return result

    def _choose(self, role: str, strategy: str, cands: list[_Live], session_key: str) -> PickResult:
        """One of ``cands`` by a strategy that weighs no KV (``kv_aware`` is ``_kv_aware``)."""
        if strategy == "random":
            return PickResult(self._rng.choice(cands).record, strategy)
        if strategy == "least_outstanding":
            best = min(cands, key=lambda v: (self.load(v.record.worker_id), self._rng.random()))
            return PickResult(best.record, strategy, cost=self.load(best.record.worker_id))
        if strategy == "power_of_two":
            two = self._rng.sample(cands, 2) if len(cands) > 1 else cands
            best = min(two, key=lambda v: self.load(v.record.worker_id))
            return PickResult(best.record, strategy, cost=self.load(best.record.worker_id))
        if strategy == "consistent_hash":
            if not session_key:
                chosen = self._round_robin(role, cands)
                return PickResult(chosen.record, "round_robin", fallback_reason="no session key")
            return PickResult(self._ring_pick(role, cands, session_key).record, strategy)
        if strategy == "weighted":
            return PickResult(self._weighted(cands).record, strategy)
        return PickResult(self._round_robin(role, cands).record, "round_robin")

    def _round_robin(self, role: str, cands: list[_Live]) -> _Live:
        cursor = self._cursor.setdefault(role, itertools.count())
        return cands[next(cursor) % len(cands)]

    def _ring_pick(self, role: str, cands: list[_Live], key: str) -> _Live:
        ids = tuple(v.record.worker_id for v in cands)
        ring_key = f"{role}|{'|'.join(ids)}"
        ring = self._rings.get(ring_key)
        if ring is None:
            points = sorted(
                (xxhash.xxh3_64_intdigest(f"{wid}#{i}".encode()), wid)
                for wid in ids
                for i in range(VNODES)
            )
            ring = ([p for p, _ in points], [w for _, w in points])
            self._rings[ring_key] = ring
        h = xxhash.xxh3_64_intdigest(key.encode())
        i = bisect.bisect(ring[0], h) % len(ring[0])
        wid = ring[1][i]
        return next(v for v in cands if v.record.worker_id == wid)

    def _weighted(self, cands: list[_Live]) -> _Live:
        # Smooth weighted round robin: even spread in proportion to the weights.
        total = sum(v.weight for v in cands)
        if total <= 0:
            return self._rng.choice(cands)
        for v in cands:
            v.current += v.weight
        best = max(cands, key=lambda v: v.current)
        best.current -= total
        return best

    def pull_credit(self, live: _Live, page: tuple[int, int] = (0, 0)) -> float:
        """Credit per block the worker would pull from another node (``pull_credit``), for
        ``page`` or, when that is (0, 0), the page its metadata names."""
        link = self.link_gbps if live.link_gbps is None else live.link_gbps
        speed = self.prefill_tokens_s if live.prefill_tokens_s is None else live.prefill_tokens_s
        page_bytes, page_tokens = page if page[0] > 0 else live.page
        return pull_credit(page_bytes, page_tokens, link, speed)

    def reachable(
        self, worker: WorkerRecord, reach: list[OwnerMatch], remote_credit: float = 0.0
    ) -> tuple[float, int]:
        """(credit, leading blocks reachable) of one worker given the index's answer;
        ``remote_credit`` per block only another node holds (0: those are recomputed)."""
        device = 0
        remote = 0
        agent_blocks, host, ssd = 0, 0, 0
        sibling = 0
        for r in reach:
            if r.kind == "worker" and (
                r.owner_id == worker.worker_id or r.address == worker.address
            ):
                device = max(device, r.matched_blocks)
            elif r.kind == "worker" and r.node and r.node == worker.node:
                # Another worker's device pages on this node: a worker announces them only
                # when it shares KV through its node's agent, which it writes them through
                # to, so they are (or within one publish interval will be) in the host tier.
                sibling = max(sibling, r.matched_blocks)
            elif r.kind == "agent" and r.node == worker.node:
                if r.matched_blocks > agent_blocks:
                    agent_blocks = r.matched_blocks
                    host = r.blocks_per_tier[0] + r.blocks_per_tier[1]  # device entries: host
                    ssd = r.blocks_per_tier[2]
            elif r.node and worker.node and r.node != worker.node:
                # Another node's agent, or a worker there (written through to its agent):
                # this worker's KV client would have its agent pull them over the link.
                remote = max(remote, r.matched_blocks)
        if sibling > agent_blocks:
            agent_blocks, host, ssd = sibling, sibling, 0
        credit = device * CREDIT_DEVICE
        extra = max(0, agent_blocks - device)
        if extra and host + ssd:
            share = host / (host + ssd)
            credit += extra * (share * CREDIT_HOST + (1 - share) * CREDIT_SSD)
        local = max(device, agent_blocks)
        if remote_credit <= 0 or remote <= local:
            return credit, local
        return credit + (remote - local) * remote_credit, remote

    def kv_costs(
        self,
        cands: list[_Live],
        reach: list[OwnerMatch],
        prompt_blocks: int,
        load_weight: float,
        page: tuple[int, int] = (0, 0),
    ) -> list[tuple[float, float, int, _Live]]:
        """(cost, prefill blocks, reachable blocks, worker) per candidate; see the module."""
        # Only a worker the answer names (by id or address) or one on a node it names can
        # reach a block; every other worker starts from the whole prompt, so the answer
        # (a few owners) is walked per worker only for those, not for all of them.
        ids = {r.owner_id for r in reach}
        addresses = {r.address for r in reach if r.address}
        nodes = {r.node for r in reach if r.node}
        # A worker on none of those nodes can only pull: the longest chain any node holds.
        remote = max((r.matched_blocks for r in reach if r.node), default=0)
        cutoff = time.monotonic() - self.outstanding_ttl_s
        whole = float(prompt_blocks)
        out = []
        for v in cands:
            rec = v.record
            per_block = 0.0
            if remote:
                per_block = v.pull if page[0] <= 0 else self.pull_credit(v, page)
            if rec.worker_id in ids or rec.address in addresses or rec.node in nodes:
                credit, reachable = self.reachable(rec, reach, per_block)
                prefill = max(prompt_blocks - credit, 0.0)
            elif per_block > 0 and rec.node:
                reachable = remote
                prefill = max(prompt_blocks - remote * per_block, 0.0)
            else:
                prefill, reachable = whole, 0
            load = self._load(v, cutoff) if v.outstanding else v.reported_queue
            cost = prefill + load_weight * load
            if v.queued:
                cost += sum(v.queued.values())
            out.append((cost, prefill, reachable, v))
        return out

    def _kv_aware(
        self,
        cands: list[_Live],
        reach: list[OwnerMatch] | None,
        prompt_blocks: int,
        temperature: float,
        load_weight: float,
        page: tuple[int, int] = (0, 0),
    ) -> PickResult:
        costs = self.kv_costs(cands, reach or [], prompt_blocks, load_weight, page)
        low = min(c[0] for c in costs)
        if temperature > 0 and len(costs) > 1:
            weights = [math.exp(-(c[0] - low) / temperature) for c in costs]
            cost, prefill, reachable, best = self._rng.choices(costs, weights=weights)[0]
        else:
            ties = [c for c in costs if c[0] <= low + 1e-9]
            cost, prefill, reachable, best = ties[self._rng.randrange(len(ties))]
        reason = "" if reach is not None else "kv index did not answer: load only"
        return PickResult(best.record, "kv_aware", reachable, cost, reason, prefill)
