"""Scheduler decisions with exact expectations: budgets, chunks, admission, preemption."""

from __future__ import annotations

from omniflow_services.worker.engine.config import EngineConfig
from omniflow_services.worker.engine.prefix_cache import PrefixCache
from omniflow_services.worker.engine.sampling import SamplingParams
from omniflow_services.worker.engine.scheduler import Scheduler, SeqState, SeqStatus


def seq(rid: str, n: int) -> SeqState:
    return SeqState(rid, list(range(n)), n, SamplingParams(), frozenset(), {}, False, None)


def advance(sched: Scheduler, plan: list) -> list[tuple[str, int]]:  # type: ignore[type-arg]
    """What the engine does after a forward: mark tokens computed, append a sampled token."""
    out = []
    for s in plan:
        out.append((s.seq.request_id, s.num_tokens))
        done = s.completes
        s.seq.num_computed += s.num_tokens
        if done:
            s.seq.tokens.append(0)
    return out


def make(pages: int = 32, budget: int = 20, max_seqs: int = 8) -> Scheduler:
    config = EngineConfig(page_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(PrefixCache(pages), config, lambda s: None)


def test_chunked_prefill_and_decode_share_the_budget() -> None:
    s = make()
    a, b, c = seq("a", 10), seq("b", 30), seq("c", 5)
    for x in (a, b, c):
        s.add(x)
    assert advance(s, s.schedule()) == [("a", 10), ("b", 10)]
    assert a.pages == [0, 1, 2] and b.pages == [3, 4, 5]
    assert advance(s, s.schedule()) == [("a", 1), ("b", 19)]  # a decodes, b continues
    assert advance(s, s.schedule()) == [("a", 1), ("b", 1), ("c", 5)]
    assert c.status is SeqStatus.RUNNING and not s.waiting


def test_max_num_seqs_limits_admission() -> None:
    s = make(max_seqs=2)
    for rid in "xyz":
        s.add(seq(rid, 3))
    assert advance(s, s.schedule()) == [("x", 3), ("y", 3)]
    assert [q.request_id for q in s.waiting] == ["z"]
    s.remove(s.running[0])
    assert advance(s, s.schedule()) == [("y", 1), ("z", 3)]


def test_waiting_request_waits_for_pages() -> None:
    s = make(pages=4, budget=64)
    a, b = seq("a", 12), seq("b", 8)
    s.add(a)
    s.add(b)
    assert advance(s, s.schedule()) == [("a", 12)]  # b needs 2 pages, 1 left
    assert b.pages == [] and s.cache.num_free == 1
    s.remove(a)
    assert advance(s, s.schedule()) == [("b", 8)]


def test_preemption_frees_the_newest_request() -> None:
    s = make(pages=4, budget=64)
    a, b = seq("a", 8), seq("b", 7)
    s.add(a)
    s.add(b)
    assert advance(s, s.schedule()) == [("a", 8), ("b", 7)]  # 2 + 2 pages: pool full
    # a needs a third page for token 9: b is preempted and recomputed later.
    assert advance(s, s.schedule()) == [("a", 1)]
    assert s.num_preemptions == 1 and b.status is SeqStatus.WAITING
    assert b.num_computed == 0 and b.pages == [] and len(b.tokens) == 8
    assert a.pages == [0, 1, 3]  # b released tail first
