"""The agent's two-tier page store: host (shared memory) over SSD, with index events.

- Budgets per tier. Making room in host demotes its least recently used unpinned page to
  SSD (a no-op write if SSD already has a copy: pages are immutable); making room in SSD
  drops its least recently used unpinned page. Pinned pages are never evicted.
- A hit on SSD promotes the page to host (the SSD copy stays, so a later demotion is free).
- Every change of the fastest tier a block is held in yields one ``BlockEvent``:
  STORED(HOST), STORED(SSD) when only SSD holds it, REMOVED when no tier does. Events queue
  up until the edge drains them and publishes them to the index in batches.

Thread-safe: one lock around each public call (SSD I/O included), so the gRPC edge can run
calls in worker threads.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from omniflow.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted
from omniflow.kv.blocks import HASH_BYTES, check_hash, check_namespace
from omniflow.kv.checksum import page_checksum
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind, Tier
from omniflow_services.kv_agent.host_tier import HostTier
from omniflow_services.kv_agent.ssd_tier import SsdTier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostSlot:
    """Slot ``slot`` of the host arena, held for page ``block_hash`` of ``namespace``."""

    namespace: bytes
    block_hash: bytes
    slot: int

    @property
    def key(self) -> bytes:
        """The page's key in the tiers (namespace and hash were checked when it was held)."""
        return self.namespace + self.block_hash


@dataclass(frozen=True, slots=True)
class Reservation(HostSlot):
    """A host slot reserved for a page a local worker is about to write in place."""


@dataclass(frozen=True, slots=True)
class PageHandle(HostSlot):
    """A pinned host page: read ``slot`` of the arena in place, then ``release`` it."""

    checksum: int
    promoted: bool  # served from SSD (promoted to host by this call)


@dataclass(frozen=True, slots=True)
class StoreStats:
    host_pages: int
    host_budget: int
    ssd_pages: int
    ssd_budget: int
    host_hits: int
    ssd_hits: int
    misses: int
    demoted: int
    dropped: int
    checksum_failures: int


def _key(namespace: bytes, block_hash: bytes) -> bytes:
    return check_namespace(namespace) + check_hash(block_hash)


class TieredStore:
    """Host + optional SSD tier of one agent; see the module docstring for the policy."""

    def __init__(
        self,
        host: HostTier,
        ssd: SsdTier | None = None,
        on_events: Callable[[list[BlockEvent]], None] | None = None,
    ) -> None:
        if ssd is not None and ssd.file.page_bytes != host.arena.page_bytes:
            raise InvalidArgument(
                f"host pages are {host.arena.page_bytes} bytes, ssd pages "
                f"{ssd.file.page_bytes}: they must match"
            )
        self.host = host
        self.ssd = ssd
        self.page_bytes = host.arena.page_bytes
        self._on_events = on_events
        self._events: deque[BlockEvent] = deque()
        self._lock = threading.RLock()
        self._reserved: dict[int, bytes] = {}
        self._counts = dict.fromkeys(
            ("host_hits", "ssd_hits", "misses", "demoted", "dropped", "checksum_failures"), 0
        )

    # --- events -----------------------------------------------------------------------------

    def _best(self, key: bytes) -> Tier | None:
        if key in self.host:
            return Tier.HOST
        if self.ssd is not None and key in self.ssd:
            return Tier.SSD
        return None

    def _emit(self, key: bytes, before: Tier | None) -> None:
        after = self._best(key)
        if after == before:
            return
        ns, h = key[:HASH_BYTES], key[HASH_BYTES:]
        if after is None:
            ev = BlockEvent(EventKind.REMOVED, ns, h, before or Tier.HOST)
        else:
            ev = BlockEvent(EventKind.STORED, ns, h, after)
        self._events.append(ev)
        if self._on_events is not None:
            self._on_events([ev])

    def drain_events(self, max_events: int | None = None) -> list[BlockEvent]:
        """Take queued events, oldest first (all of them, or at most ``max_events``)."""
        with self._lock:
            n = len(self._events) if max_events is None else min(max_events, len(self._events))
            return [self._events.popleft() for _ in range(n)]

    def entries(self) -> list[BlockEntry]:
        """Everything held, with its fastest tier: the snapshot sent to the index."""
        with self._lock:
            out = [BlockEntry(k[:HASH_BYTES], k[HASH_BYTES:], Tier.HOST) for k in self.host.keys()]
            if self.ssd is not None:
                out += [
                    BlockEntry(k[:HASH_BYTES], k[HASH_BYTES:], Tier.SSD)
                    for k in self.ssd.keys()
                    if k not in self.host
                ]
            return out

    # --- making room ------------------------------------------------------------------------

    def _make_ssd_room(self) -> bool:
        assert self.ssd is not None
        while self.ssd.full:
            victim = self.ssd.lru_victim()
            if victim is None:
                return False
            before = self._best(victim)
            self.ssd.remove(victim)
            self._counts["dropped"] += 1
            self._emit(victim, before)
        return True

    def _demote(self, key: bytes) -> None:
        """Move a host page out of host: to SSD if there is (or can be) room, else drop it."""
        page = self.host.get(key, touch=False)
        assert page is not None and not page.pins
        before = self._best(key)
        if self.ssd is not None and key in self.ssd:
            self.ssd.get(key)  # its SSD copy is now its most recent place
        elif self.ssd is not None and self._make_ssd_room():
            self.ssd.write(key, self.host.arena.view(page.slot), page.checksum)
            self._counts["demoted"] += 1
        else:
            self._counts["dropped"] += 1
        self.host.remove(key)
        self._emit(key, before)

    def _host_slot(self) -> int:
        while True:
            slot = self.host.reserve_slot()
            if slot is not None:
                return slot
            victim = self.host.lru_victim()
            if victim is None:
                raise ResourceExhausted(
                    f"host tier full: all {len(self.host)} pages pinned and "
                    f"{self.host.reserved_slots} slots reserved; retry after releases"
                )
            self._demote(victim)

    # --- writes -----------------------------------------------------------------------------

    def reserve(self, namespace: bytes, block_hash: bytes) -> Reservation | None:
        """Reserve a host slot for a page the caller writes in place; None if already held."""
        key = _key(namespace, block_hash)
        with self._lock:
            if self._best(key) is not None:
                self._touch(key)
                return None
            slot = self._host_slot()
            self._reserved[slot] = key
            return Reservation(namespace, block_hash, slot)

    def commit(self, res: Reservation, checksum: int | None = None) -> int:
        """Publish a reserved slot's page; returns its checksum.

        ``checksum``, if given, is verified: a mismatch frees the slot and raises DataLoss.
        """
        with self._lock:
            key = self._reserved.pop(res.slot, None)
            if key != res.key:
                raise FailedPrecondition(f"slot {res.slot} is not reserved for this page")
            got = page_checksum(self.host.arena.view(res.slot))
            if checksum is not None and got != checksum:
                self.host.release_slot(res.slot)
                self._counts["checksum_failures"] += 1
                raise DataLoss(
                    f"page {res.block_hash.hex()} checksum {got:016x} != sent {checksum:016x}; "
                    "dropped"
                )
            before = self._best(key)
            if before is not None:  # raced with another writer of the same page: keep theirs
                self.host.release_slot(res.slot)
                return got
            self.host.insert(key, res.slot, got)
            self._emit(key, before)
            return got

    def abort(self, res: Reservation) -> None:
        with self._lock:
            if self._reserved.pop(res.slot, None) is not None:
                self.host.release_slot(res.slot)

    def reserve_any(self) -> int:
        """Reserve a host slot for a page not named yet; ``commit_slot`` names it."""
        with self._lock:
            slot = self._host_slot()
            self._reserved[slot] = b""
            return slot

    def commit_slot(
        self, slot: int, namespace: bytes, block_hash: bytes, checksum: int | None = None
    ) -> int:
        """Commit a slot reserved by ``reserve`` (for this page) or ``reserve_any``."""
        key = _key(namespace, block_hash)
        with self._lock:
            held = self._reserved.get(slot)
            if held == b"":
                self._reserved[slot] = key
            elif held != key:  # checked here so that a wrong commit keeps the reservation
                raise FailedPrecondition(
                    f"slot {slot} is not reserved for page {block_hash.hex()}; reserve it first"
                )
            return self.commit(Reservation(namespace, block_hash, slot), checksum)

    def abort_slot(self, slot: int) -> bool:
        """Give a reserved slot back unwritten; False if it was not reserved."""
        with self._lock:
            if self._reserved.pop(slot, None) is None:
                return False
            self.host.release_slot(slot)
            return True

    def put(
        self,
        namespace: bytes,
        block_hash: bytes,
        data: bytes | bytearray | memoryview | np.ndarray,
        checksum: int | None = None,
    ) -> int:
        """Copy a page into host (one memcpy); returns its checksum. Idempotent."""
        size = data.nbytes if isinstance(data, np.ndarray | memoryview) else len(data)
        if size != self.page_bytes:
            raise InvalidArgument(f"page is {size} bytes; this agent's pages are {self.page_bytes}")
        with self._lock:
            res = self.reserve(namespace, block_hash)
            if res is None:
                page = self.host.get(_key(namespace, block_hash), touch=False)
                if page is not None:
                    return page.checksum
                assert self.ssd is not None
                return self.ssd.get(_key(namespace, block_hash), touch=False).checksum  # type: ignore[union-attr]
            try:
                self.host.arena.write(res.slot, data)
            except BaseException:
                self.abort(res)
                raise
            return self.commit(res, checksum)

    # --- reads ------------------------------------------------------------------------------

    def _touch(self, key: bytes) -> None:
        if self.host.get(key) is None and self.ssd is not None:
            self.ssd.get(key)

    def tier_of(self, namespace: bytes, block_hash: bytes) -> Tier | None:
        with self._lock:
            return self._best(_key(namespace, block_hash))

    def acquire(self, namespace: bytes, block_hash: bytes) -> PageHandle | None:
        """Pin a page in host (promoting it from SSD if needed); None on a miss.

        Raises DataLoss if the SSD copy fails its checksum (the page is dropped).
        """
        key = _key(namespace, block_hash)
        with self._lock:
            page = self.host.get(key)
            if page is not None:
                page.pins += 1
                self._counts["host_hits"] += 1
                return PageHandle(namespace, block_hash, page.slot, page.checksum, False)
            if self.ssd is None or self.ssd.get(key) is None:
                self._counts["misses"] += 1
                return None
            slot = self._host_slot()
            if key not in self.ssd:  # making room dropped it after all
                self.host.release_slot(slot)
                self._counts["misses"] += 1
                return None
            try:
                self.ssd.read_into(key, self.host.arena.view(slot))
            except DataLoss:
                self.host.release_slot(slot)
                self._counts["checksum_failures"] += 1
                self._emit(key, Tier.SSD)
                raise
            except BaseException:
                self.host.release_slot(slot)
                raise
            checksum = self.ssd.get(key, touch=False).checksum  # type: ignore[union-attr]
            self.host.insert(key, slot, checksum, pins=1)
            self._counts["ssd_hits"] += 1
            self._emit(key, Tier.SSD)
            return PageHandle(namespace, block_hash, slot, checksum, True)

    def acquire_chain(self, namespace: bytes, hashes: list[bytes]) -> list[PageHandle]:
        """Pin the leading run of ``hashes`` this agent holds (SSD pages prefetched, then
        promoted). Stops at the first miss, checksum failure, or when host is full of pinned
        pages; the caller releases every handle returned.
        """
        keys = [_key(namespace, h) for h in hashes]
        out: list[PageHandle] = []
        with self._lock:
            if self.ssd is not None:
                slots = []
                for k in keys:
                    if k in self.host:
                        continue
                    page = self.ssd.get(k, touch=False)
                    if page is None:
                        break
                    slots.append(page.slot)
                self.ssd.file.prefetch(slots)
            for h in hashes:
                try:
                    handle = self.acquire(namespace, h)
                except DataLoss:
                    break
                except ResourceExhausted:
                    if not out:
                        raise
                    break
                if handle is None:
                    break
                out.append(handle)
        return out

    def release(self, handle: PageHandle) -> None:
        with self._lock:
            page = self.host.get(handle.key, touch=False)
            if page is None or page.pins <= 0:
                raise FailedPrecondition(f"page {handle.block_hash.hex()} is not pinned")
            page.pins -= 1

    def read(self, namespace: bytes, block_hash: bytes) -> bytes | None:
        """A copy of a page (for the network path); None on a miss."""
        handle = self.acquire(namespace, block_hash)
        if handle is None:
            return None
        try:
            return self.host.arena.view(handle.slot).tobytes()
        finally:
            self.release(handle)

    # --- removal ----------------------------------------------------------------------------

    def remove(self, namespace: bytes, block_hash: bytes) -> bool:
        """Drop a page from every tier; False if absent. Pinned pages raise FailedPrecondition."""
        key = _key(namespace, block_hash)
        with self._lock:
            before = self._best(key)
            if before is None:
                return False
            if key in self.host:
                self.host.remove(key)
            if self.ssd is not None and key in self.ssd:
                self.ssd.remove(key)
            self._emit(key, before)
            return True

    def evict(self, namespace: bytes, block_hash: bytes, tier: Tier | None = None) -> bool:
        """Evict one page: from host (demoted to SSD when there is one), from SSD only, or
        (``tier`` None) from every tier. False if the page was not in that tier."""
        if tier is None:
            return self.remove(namespace, block_hash)
        key = _key(namespace, block_hash)
        with self._lock:
            if tier == Tier.HOST:
                page = self.host.get(key, touch=False)
                if page is None:
                    return False
                if page.pins:
                    raise FailedPrecondition(f"page {block_hash.hex()} is pinned ({page.pins})")
                self._demote(key)
                return True
            if tier == Tier.SSD and self.ssd is not None and key in self.ssd:
                before = self._best(key)
                self.ssd.remove(key)
                self._counts["dropped"] += 1
                self._emit(key, before)
                return True
            return False

    def free_host(self, pages: int) -> int:
        """Demote least recently used unpinned host pages until ``pages`` slots are free
        under the budget (or nothing unpinned is left); returns how many were moved out."""
        moved = 0
        with self._lock:
            while self.host.budget_pages - len(self.host) - self.host.reserved_slots < pages:
                victim = self.host.lru_victim()
                if victim is None:
                    break
                self._demote(victim)
                moved += 1
        return moved

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                host_pages=len(self.host),
                host_budget=self.host.budget_pages,
                ssd_pages=len(self.ssd) if self.ssd is not None else 0,
                ssd_budget=self.ssd.budget_pages if self.ssd is not None else 0,
                **self._counts,
            )
