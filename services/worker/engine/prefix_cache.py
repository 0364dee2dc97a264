"""Page allocation with a prefix cache over block hashes (DESIGN.md §4.1).

A page is in exactly one state: free (no hash, no reference), in use (reference count > 0,
maybe hashed), or cached (hashed, unreferenced, in the LRU and reusable until evicted).
Allocation takes free pages first, then evicts the least recently released cached pages.
"No capacity" is a ``None`` return, never an exception: the scheduler decides what to do.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockEvents:
    """Hashes that entered or left the device pool since the last drain (for the index)."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class PrefixCache:
    """Reference-counted page allocator whose full pages are reusable by block hash."""

    def __init__(self, num_pages: int, enabled: bool = True) -> None:
        self.num_pages = num_pages
        self.enabled = enabled
        self._ref = [0] * num_pages
        self._hash: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._events = BlockEvents()

    @property
    def num_free(self) -> int:
        """Pages an allocation can get now (free plus evictable cached pages)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def page_of(self, block_hash: bytes) -> int | None:
        return self._page_of.get(block_hash)

    def cached_hashes(self) -> list[bytes]:
        """Every block hash the pool holds now (a snapshot for the KV index)."""
        return list(self._page_of)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of ``hashes``; each gets a reference."""
        if not self.enabled:
            return []
        pages: list[int] = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._acquire(page)
        return pages

    def _acquire(self, page: int) -> None:
        if self._ref[page] == 0:
            self._lru.pop(page, None)
        self._ref[page] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages with one reference each, or None when fewer are available."""
        if n > self.num_free:
            return None
        out: list[int] = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._lru.popitem(last=False)
                self._forget(page)
            self._ref[page] = 1
            out.append(page)
        return out

    def _forget(self, page: int) -> None:
        h = self._hash[page]
        if h is not None:
            self._hash[page] = None
            if self._page_of.get(h) == page:
                del self._page_of[h]
                self._events.removed.append(h)

    def register(self, page: int, block_hash: bytes) -> bool:
        """Mark an in-use full page as holding ``block_hash``; False if already cached elsewhere.

        A duplicate (two requests computed the same block concurrently) stays private to
        its request and returns to the free list when released.
        """
        if not self.enabled or self._hash[page] is not None:
            return False
        if block_hash in self._page_of:
            return False
        self._hash[page] = block_hash
        self._page_of[block_hash] = page
        self._events.stored.append(block_hash)
        return True

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page; tail pages first so they are evicted first."""
        for page in reversed(pages):
            self._ref[page] -= 1
            if self._ref[page] < 0:
                raise RuntimeError(f"page {page} released more often than acquired")
            if self._ref[page] == 0:
                if self._hash[page] is not None:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def clear(self) -> int:
        """Forget every cached, unreferenced page (e.g. after a weight reload); returns count."""
        n = len(self._lru)
        while self._lru:
            page, _ = self._lru.popitem(last=False)
            self._forget(page)
            self._free.append(page)
        return n

    def drain_events(self) -> BlockEvents:
        ev, self._events = self._events, BlockEvents()
        return ev
