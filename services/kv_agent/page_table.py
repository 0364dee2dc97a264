"""The LRU/pin page table both agent tiers keep: key → page, oldest first, pin counts.

Keys are ``namespace + block_hash`` (32 bytes); a page is any record with a ``slot`` and
a ``pins`` count (the host tier's arena slot, the SSD tier's file slot). Eviction takes the
least recently used page nobody pins. Not thread-safe: the store locks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from omniflow.errors import FailedPrecondition


class Pinnable(Protocol):
    slot: int
    pins: int


P = TypeVar("P", bound=Pinnable)


class PageTable(Generic[P]):
    """Pages in LRU order (a ``get`` with ``touch`` makes one the newest) with pins."""

    #: How the table names its pages in errors ("page", "ssd page").
    label = "page"

    def __init__(self) -> None:
        self._pages: OrderedDict[bytes, P] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def get(self, key: bytes, touch: bool = True) -> P | None:
        page = self._pages.get(key)
        if page is not None and touch:
            self._pages.move_to_end(key)
        return page

    def _put(self, key: bytes, page: P) -> P:
        self._pages[key] = page
        return page

    def _take(self, key: bytes, force: bool = False) -> P:
        """Drop ``key`` from the table (KeyError if absent); FailedPrecondition if it is
        pinned, unless ``force``. The caller frees its slot."""
        page = self._pages[key]
        if page.pins and not force:
            raise FailedPrecondition(f"{self.label} {key.hex()} is pinned ({page.pins})")
        del self._pages[key]
        return page

    def lru_victim(self) -> bytes | None:
        """The least recently used unpinned page, or None if every page is pinned."""
        for key, page in self._pages.items():
            if not page.pins:
                return key
        return None

    def keys(self) -> list[bytes]:
        return list(self._pages)
