"""Host arena, SSD file and the two-tier store: allocation, eviction order, events, restart."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omniflow.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from omniflow.kv.checksum import page_checksum
from omniflow.kv.events import BlockEvent, Tier
from omniflow_services.kv_agent.host_tier import HostArena, HostTier, SlotAllocator
from omniflow_services.kv_agent.ssd_tier import SsdFile, SsdTier
from omniflow_services.kv_agent.tiers import TieredStore

PAGE = 4096 + 100  # not a multiple of the alignment on purpose
NS = bytes(range(16))


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def page(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


@pytest.fixture
def arena() -> Iterator[HostArena]:
    a = HostArena.create(f"test-{uuid.uuid4().hex[:8]}", PAGE, 4)
    try:
        yield a
    finally:
        a.close()
        a.unlink()


def _child_writes(name: str, slot: int, seed: int) -> None:
    other = HostArena.attach(name)
    other.write(slot, page(seed))
    other.close()


def test_arena_shared_between_processes(arena: HostArena) -> None:
    name = arena.path.name.removeprefix("omniflow-")
    proc = mp.get_context("spawn").Process(target=_child_writes, args=(name, 2, 7))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    out = bytearray(PAGE)
    arena.read_into(2, out)
    assert bytes(out) == page(7)
    assert arena.view(2).tobytes() == page(7)
    with pytest.raises(InvalidArgument, match="out of range"):
        arena.view(4)
    with pytest.raises(InvalidArgument, match="bytes"):
        arena.write(0, b"short")
    with pytest.raises(NotFound):
        HostArena.attach("no-such-arena-" + uuid.uuid4().hex[:6])


def test_slot_allocator() -> None:
    alloc = SlotAllocator(3, used={1})
    assert [alloc.alloc(), alloc.alloc(), alloc.alloc()] == [0, 2, None]
    alloc.free(2)
    assert alloc.alloc() == 2  # LIFO: the freed slot first
    with pytest.raises(ValueError):
        alloc.free(1) or alloc.free(1)


def make_store(
    arena: HostArena, tmp_path: Path, ssd_pages: int = 3, events: list[BlockEvent] | None = None
) -> TieredStore:
    ssd = SsdTier(SsdFile.open(tmp_path / "pages.bin", PAGE, ssd_pages))
    cb = events.extend if events is not None else None
    return TieredStore(HostTier(arena, budget_pages=2), ssd, on_events=cb)


def kinds(events: list[BlockEvent]) -> list[tuple[str, int, str]]:
    return [(e.kind.name, int.from_bytes(e.block_hash, "big"), e.tier.name) for e in events]


def test_eviction_order_demotion_and_promotion(arena: HostArena, tmp_path: Path) -> None:
    store = make_store(arena, tmp_path)
    for i in range(3):
        store.put(NS, h(i), page(i))
    # Host budget 2: page 0 (LRU) was demoted to SSD.
    assert [store.tier_of(NS, h(i)) for i in range(3)] == [Tier.SSD, Tier.HOST, Tier.HOST]
    assert kinds(store.drain_events()) == [
        ("STORED", 0, "HOST"),
        ("STORED", 1, "HOST"),
        ("STORED", 0, "SSD"),
        ("STORED", 2, "HOST"),
    ]
    # Touch 1 so that 2 is the LRU, then hit 0 on SSD: promoted, 2 demoted.
    assert store.read(NS, h(1)) == page(1)
    assert store.read(NS, h(0)) == page(0)
    assert kinds(store.drain_events()) == [("STORED", 2, "SSD"), ("STORED", 0, "HOST")]
    stats = store.stats()
    assert (stats.host_hits, stats.ssd_hits, stats.demoted) == (1, 1, 2)
    # SSD holds 0 (kept after promotion) and 2; add pages until SSD drops its LRU.
    store.put(NS, h(3), page(3))  # demotes 1 → SSD full (0, 2, 1)
    store.put(NS, h(4), page(4))  # demotes 0: already on SSD, no write
    store.put(NS, h(5), page(5))  # demotes 3: SSD drops its LRU (2)
    assert store.tier_of(NS, h(2)) is None
    ev = kinds(store.drain_events())
    assert ("REMOVED", 2, "SSD") in ev
    assert ev[-1] == ("STORED", 5, "HOST")
    assert sorted(e.block_hash for e in store.entries()) == sorted(h(i) for i in (0, 1, 3, 4, 5))


def test_pinned_pages_are_not_evicted(arena: HostArena, tmp_path: Path) -> None:
    store = make_store(arena, tmp_path)
    store.put(NS, h(0), page(0))
    store.put(NS, h(1), page(1))
    a = store.acquire(NS, h(0))
    b = store.acquire(NS, h(1))
    assert a is not None and b is not None
    with pytest.raises(ResourceExhausted, match="pinned"):
        store.put(NS, h(2), page(2))
    with pytest.raises(FailedPrecondition, match="pinned"):
        store.remove(NS, h(0))
    store.release(b)
    store.put(NS, h(2), page(2))  # evicts 1, not the pinned 0
    assert store.tier_of(NS, h(0)) == Tier.HOST and store.tier_of(NS, h(1)) == Tier.SSD
    assert arena.view(a.slot).tobytes() == page(0)
    store.release(a)
    with pytest.raises(FailedPrecondition):
        store.release(a)


def test_reserve_commit_in_place(arena: HostArena, tmp_path: Path) -> None:
    events: list[BlockEvent] = []
    store = make_store(arena, tmp_path, events=events)
    res = store.reserve(NS, h(9))
    assert res is not None
    arena.view(res.slot)[:] = np.frombuffer(page(9), dtype=np.uint8)
    assert store.tier_of(NS, h(9)) is None  # not visible before commit
    assert store.commit(res, page_checksum(page(9))) == page_checksum(page(9))
    assert store.reserve(NS, h(9)) is None  # already held
    assert kinds(events) == [("STORED", 9, "HOST")]
    bad = store.reserve(NS, h(10))
    assert bad is not None
    with pytest.raises(DataLoss):
        store.commit(bad, 12345)
    assert store.tier_of(NS, h(10)) is None and store.stats().checksum_failures == 1
    with pytest.raises(InvalidArgument, match="pages are"):
        store.put(NS, h(11), b"x" * 10)


def test_ssd_restart_reannounces_and_detects_corruption(arena: HostArena, tmp_path: Path) -> None:
    store = make_store(arena, tmp_path)
    for i in range(4):
        store.put(NS, h(i), page(i))  # 0 and 1 end up on SSD
    assert store.ssd is not None
    store.ssd.file.close()
    # A new agent on the same file: SSD pages come back, and are served correctly.
    ssd = SsdTier(SsdFile.open(tmp_path / "pages.bin", PAGE, 3))
    assert sorted(ssd.keys()) == [NS + h(0), NS + h(1)]
    arena2 = HostArena.create(f"test-{uuid.uuid4().hex[:8]}", PAGE, 2)
    try:
        store2 = TieredStore(HostTier(arena2), ssd)
        assert {e.tier for e in store2.entries()} == {Tier.SSD}
        assert store2.read(NS, h(1)) == page(1)
        # Flip one byte of page 0 on disk: detected on read, dropped, counted.
        slot = ssd.get(NS + h(0), touch=False).slot  # type: ignore[union-attr]
        fd = os.open(tmp_path / "pages.bin", os.O_RDWR)
        off = ssd.file.data_offset + slot * ssd.file.stride + 17
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
        os.close(fd)
        with pytest.raises(DataLoss, match="checksum"):
            store2.acquire(NS, h(0))
        assert store2.tier_of(NS, h(0)) is None
        assert store2.stats().checksum_failures == 1
        assert kinds(store2.drain_events())[-1] == ("REMOVED", 0, "SSD")
        ssd.file.close()
    finally:
        arena2.close()
        arena2.unlink()
    with pytest.raises(FailedPrecondition, match="pages of"):
        SsdFile.open(tmp_path / "pages.bin", PAGE, 5)


def test_acquire_chain_promotes_and_stops_at_first_miss(arena: HostArena, tmp_path: Path) -> None:
    store = make_store(arena, tmp_path, ssd_pages=4)
    for i in range(4):
        store.put(NS, h(i), page(i))  # 0, 1 on SSD; 2, 3 in host
    store.remove(NS, h(3))
    store.drain_events()
    handles = store.acquire_chain(NS, [h(0), h(1), h(2), h(3), h(4)])
    # Host holds 2 pages: 0 promoted, then 1 needs room but 0 is pinned, so 2 (unpinned)
    # is demoted; then 2 needs room again and everything is pinned: the chain stops there.
    assert [hd.block_hash for hd in handles] == [h(0), h(1)]
    assert [arena.view(hd.slot).tobytes() for hd in handles] == [page(0), page(1)]
    for hd in handles:
        store.release(hd)
    assert [hd.block_hash for hd in store.acquire_chain(NS, [h(5)])] == []
    assert store.stats().misses == 1


def test_ssd_read_drops_a_corrupt_page(tmp_path: Path) -> None:
    ssd = SsdTier(SsdFile.open(tmp_path / "p.bin", PAGE, 4))
    for i in range(3):
        ssd.write(NS + h(i), page(i), page_checksum(page(i)))
    slot = ssd.get(NS + h(1), touch=False).slot  # type: ignore[union-attr]
    fd = os.open(tmp_path / "p.bin", os.O_RDWR)
    os.pwrite(fd, b"\x00" * 8, ssd.file.data_offset + slot * ssd.file.stride)
    os.close(fd)
    outs = [bytearray(PAGE) for _ in range(3)]
    ssd.read_into(NS + h(0), outs[0])
    with pytest.raises(DataLoss, match="checksum"):
        ssd.read_into(NS + h(1), outs[1])
    ssd.read_into(NS + h(2), outs[2])
    assert bytes(outs[0]) == page(0) and bytes(outs[2]) == page(2)
    assert NS + h(1) not in ssd
    ssd.file.close()
