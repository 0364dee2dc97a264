"""Host tier: the agent's page table over the node's shared-memory arena.

The arena file (``omniflow.kv.arena.HostArena``) is mapped by the agent and by the node's
workers; only the agent process allocates its slots (``SlotAllocator``) and owns the page
table (``HostTier``), with its LRU order and pins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omniflow.kv.arena import HostArena
from omniflow_services.kv_agent.page_table import PageTable

log = logging.getLogger(__name__)


class SlotAllocator:
    """Free list of slot numbers; LIFO so a recently freed (cache-warm) slot is reused first."""

    def __init__(self, num_slots: int, used: set[int] | None = None) -> None:
        used = used or set()
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in used]
        self._used = bytearray(num_slots)
        for s in used:
            self._used[s] = 1
        self.num_slots = num_slots

    def alloc(self) -> int | None:
        """A free slot, or None when full (no capacity is a value, not an error)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        if not self._used[slot]:
            raise ValueError(f"slot {slot} freed twice")
        self._used[slot] = 0
        self._free.append(slot)

    @property
    def used_count(self) -> int:
        return self.num_slots - len(self._free)


@dataclass(slots=True)
class HostPage:
    """A page in the host arena; ``pins`` > 0 means a reader or a transfer holds it."""

    slot: int
    checksum: int
    pins: int = 0


class HostTier(PageTable[HostPage]):
    """The agent's page table over an arena: key → slot, LRU order, pin counts, a budget.

    Keys are ``namespace + block_hash`` (32 bytes). Not thread-safe: the store locks.
    """

    def __init__(self, arena: HostArena, budget_pages: int | None = None) -> None:
        super().__init__()
        self.arena = arena
        self.budget_pages = min(budget_pages or arena.num_slots, arena.num_slots)
        self._alloc = SlotAllocator(arena.num_slots)

    def reserve_slot(self) -> int | None:
        """A slot for a new page, or None when the budget or the arena is full."""
        if self._alloc.used_count >= self.budget_pages:
            return None
        return self._alloc.alloc()

    def release_slot(self, slot: int) -> None:
        self._alloc.free(slot)

    def insert(self, key: bytes, slot: int, checksum: int, pins: int = 0) -> HostPage:
        return self._put(key, HostPage(slot, checksum, pins))

    def remove(self, key: bytes) -> HostPage:
        page = self._take(key)
        self._alloc.free(page.slot)
        return page

    @property
    def reserved_slots(self) -> int:
        """Slots allocated but not (yet) in the table: reservations in flight."""
        return self._alloc.used_count - len(self)
