"""PrefixCache: exact page ids, reference counts, LRU eviction, "no capacity" as None."""

from __future__ import annotations

import pytest

from omniflow_services.worker.engine.prefix_cache import PrefixCache


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_allocate_release_and_no_capacity() -> None:
    c = PrefixCache(4)
    assert c.allocate(3) == [0, 1, 2]
    assert c.allocate(2) is None  # only one left: a value, not an exception
    assert c.num_free == 1
    c.release([0, 1, 2])
    assert c.num_free == 4
    assert c.allocate(4) == [3, 2, 1, 0]  # freed pages come back tail first


def test_match_reuses_registered_pages_and_counts_refs() -> None:
    c = PrefixCache(6)
    pages = c.allocate(3)
    assert pages == [0, 1, 2]
    for p, i in zip(pages, range(3), strict=True):
        assert c.register(p, h(i))
    assert c.match([h(0), h(1), h(9), h(2)]) == [0, 1]  # stops at the first miss
    assert c.ref_count(0) == 2 and c.ref_count(2) == 1
    c.release(pages)
    assert c.ref_count(0) == 1 and c.num_free == 4  # page 2 is cached, evictable
    assert c.page_of(h(2)) == 2
    ev = c.drain_events()
    assert ev.stored == [h(0), h(1), h(2)] and ev.removed == []


def test_lru_evicts_least_recently_released_and_tail_first() -> None:
    c = PrefixCache(4)
    a = c.allocate(2)
    b = c.allocate(2)
    assert a == [0, 1] and b == [2, 3]
    for p in (*a, *b):
        c.register(p, h(p))
    c.release(a)  # LRU order now: 1, 0 (tail of chain first)
    c.release(b)  # then 3, 2
    c.drain_events()
    assert c.allocate(1) == [1]
    assert c.page_of(h(1)) is None and c.page_of(h(0)) == 0
    assert c.match([h(0)]) == [0]  # a hit takes page 0 out of the LRU
    assert c.allocate(2) == [3, 2]
    assert c.allocate(1) is None
    assert c.drain_events().removed == [h(1), h(3), h(2)]


def test_duplicate_block_stays_private() -> None:
    c = PrefixCache(3)
    p1, p2 = c.allocate(2)  # type: ignore[misc]
    assert c.register(p1, h(5))
    assert not c.register(p2, h(5))
    c.release([p2])
    assert c.allocate(1) == [2]  # free list first ...
    assert c.allocate(1) == [p2]  # ... then the unhashed duplicate, not the cached page


def test_disabled_cache_never_matches() -> None:
    c = PrefixCache(2, enabled=False)
    (p,) = c.allocate(1)  # type: ignore[misc]
    assert not c.register(p, h(1))
    assert c.match([h(1)]) == []


def test_over_release_is_a_bug() -> None:
    c = PrefixCache(1)
    (p,) = c.allocate(1)  # type: ignore[misc]
    c.release([p])
    with pytest.raises(RuntimeError):
        c.release([p])
