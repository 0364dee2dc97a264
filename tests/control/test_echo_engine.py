"""The echo TEST worker's compute model: steps, chunked prefill, LRU prefix cache (no
network, no sleeping — the tests drive ``plan``/``apply`` by hand)."""

from __future__ import annotations

import pytest

from omniflow_services.worker.echo.engine import ComputeModel, EchoEngine

MODEL = ComputeModel(prefill_us=10, decode_us=100, step_us=1000, step_tokens=64)


def _hashes(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def _drain(req) -> list[int | None]:
    out = []
    while not req.tokens.empty():
        out.append(req.tokens.get_nowait())
    return out


def test_step_time_chunked_prefill_then_decode():
    events: list[tuple[list[bytes], list[bytes]]] = []
    e = EchoEngine(
        MODEL, cache_blocks=100, page_size=16, on_blocks=lambda s, v: events.append((s, v))
    )
    a = e.submit(100, _hashes(1, 6), max_new=2)
    p = e.plan()
    assert [(r.rid, n) for r, n in p.prefill] == [(a.rid, 64)] and p.decode == ()
    assert p.seconds == pytest.approx((1000 + 64 * 10) / 1e6)
    e.apply(p)
    assert _drain(a) == [] and events == [(_hashes(1, 4), [])]
    p = e.plan()
    assert [n for _, n in p.prefill] == [36]
    e.apply(p)
    assert _drain(a) == [1]  # the step that ends the prefill gives the first token
    assert events[-1] == (_hashes(1, 6)[4:], [])
    p = e.plan()
    assert p.prefill == () and p.decode == (a,)
    assert p.seconds == pytest.approx((1000 + 100) / 1e6)
    e.apply(p)
    assert _drain(a) == [2, None] and e.running == [] and e.plan() is None
    assert (e.prompt_tokens, e.hit_tokens, e.computed_tokens) == (100, 0, 100)


def test_concurrent_requests_share_the_step_budget_first_come_first_served():
    e = EchoEngine(MODEL, cache_blocks=100, page_size=16)
    a = e.submit(40, _hashes(1, 2), max_new=3)
    b = e.submit(40, _hashes(2, 2), max_new=3)
    p = e.plan()
    assert [(r.rid, n) for r, n in p.prefill] == [(a.rid, 40), (b.rid, 24)]
    e.apply(p)
    p = e.plan()
    # a decodes (one budget token) while b finishes its prefill in the same, longer step.
    assert p.decode == (a,) and [(r.rid, n) for r, n in p.prefill] == [(b.rid, 16)]
    assert p.seconds == pytest.approx((1000 + 100 + 160) / 1e6)


def test_prefix_reuse_and_the_last_token_recomputed():
    e = EchoEngine(MODEL, cache_blocks=100, page_size=16)
    a = e.submit(64, _hashes(1, 4), max_new=1)
    while (p := e.plan()) is not None:
        e.apply(p)
    assert _drain(a) == [1, None]
    b = e.submit(64, _hashes(1, 4), max_new=1)  # the same prompt: every block cached
    c = e.submit(70, [*_hashes(1, 2), *_hashes(3, 2)], max_new=1)  # shares 2 blocks
    p = e.plan()
    assert (b.cached, c.cached) == (63, 32)
    assert [n for _, n in p.prefill] == [1, 38]
    assert e.hit_tokens == 95 and e.prompt_tokens == 64 + 64 + 70


def _serve(e: EchoEngine, tag: int, blocks: int) -> None:
    e.submit(blocks * 16, _hashes(tag, blocks), max_new=1)
    while (p := e.plan()) is not None:
        e.apply(p)


def test_lru_evicts_the_least_recently_used_chain_tail_first_and_reports_it():
    events: list[tuple[list[bytes], list[bytes]]] = []
    e = EchoEngine(
        MODEL, cache_blocks=4, page_size=16, on_blocks=lambda s, v: events.append((s, v))
    )
    _serve(e, 1, 2)
    _serve(e, 2, 2)
    _serve(e, 1, 2)  # touches tag 1: tag 2 is now the oldest
    _serve(e, 3, 2)
    a, b, c = _hashes(1, 2), _hashes(2, 2), _hashes(3, 2)
    assert events[-1] == (c, [b[1], b[0]])  # the tail of the chain goes before its head
    assert list(e.cache.blocks) == [a[1], a[0], c[1], c[0]]


def test_a_chain_longer_than_the_cache_keeps_its_head():
    e = EchoEngine(MODEL, cache_blocks=3, page_size=16)
    _serve(e, 1, 4)
    assert set(e.cache.blocks) == set(_hashes(1, 3))
    r = e.submit(64, _hashes(1, 4), max_new=1)
    e.plan()
    assert r.cached == 48  # a head-first LRU would have kept blocks 1-3: no reuse at all


def test_cancel_frees_the_batch_and_max_running_holds_the_rest():
    e = EchoEngine(ComputeModel(step_tokens=64, max_running=1), cache_blocks=10, page_size=16)
    a = e.submit(32, _hashes(1, 2), max_new=5)
    b = e.submit(32, _hashes(2, 2), max_new=5)
    p = e.plan()
    assert e.running == [a] and list(e.waiting) == [b] and [r for r, _ in p.prefill] == [a]
    e.cancel(a)
    e.apply(p)  # a's step completes after the cancel: nothing is accounted for it
    assert e.computed_tokens == 0 and e.running == []
    p = e.plan()
    assert e.running == [b] and [r for r, _ in p.prefill] == [b]
