"""The agent's page pools: one host arena + optional SSD file + tiered store per page size.

A namespace's page size comes from its KV layout; every namespace with that page size
shares the pool. Pools are made on first use and, for SSD files left by a previous run
(``<ssd path>.<page bytes>``), at start, so that their pages are announced again.

Also here: pins handed to local readers (``LocatePages``) and slot reservations handed to
local writers (``CommitPages``), each with a deadline so that a worker that dies holding
one does not leak it. No gRPC in this module.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omniflow.errors import InvalidArgument, NotFound, ResourceExhausted
from omniflow.kv.arena import DEFAULT_SHM_DIR, HEADER_BYTES, HostArena
from omniflow.kv.events import BlockEvent, Tier
from omniflow_services.kv_agent.config import KVAgentSettings
from omniflow_services.kv_agent.host_tier import HostTier
from omniflow_services.kv_agent.ssd_tier import SsdFile, SsdTier
from omniflow_services.kv_agent.tiers import PageHandle, TieredStore

log = logging.getLogger(__name__)

_SSD_ALIGN = 4096
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(text: str) -> str:
    """``text`` with every character an arena name does not accept replaced by ``_``."""
    return _UNSAFE.sub("_", text)[:80] or "agent"


@dataclass(slots=True)
class PagePool:
    """Everything of one page size."""

    page_bytes: int
    arena: HostArena
    store: TieredStore
    shm_name: str

    @property
    def base_address(self) -> int:
        """Address of the mapping in this process (for NIXL registration)."""
        return int(self.arena.view(0).ctypes.data) - HEADER_BYTES

    @property
    def mapping_bytes(self) -> int:
        return HEADER_BYTES + self.arena.stride * self.arena.num_slots


@dataclass(slots=True)
class _Pin:
    pool: PagePool
    handles: list[PageHandle]
    deadline: float


class Pools:
    """The pools of one agent, and the pins and reservations of its local clients.

    Each pool's budgets are the agent's settings: a host arena of ``host_bytes``, an SSD
    file of ``ssd_bytes`` at ``<ssd_path>.<page bytes>``, at most ``max_arenas`` pools."""

    def __init__(
        self,
        name: str,
        settings: KVAgentSettings,
        *,
        shm_dir: Path = DEFAULT_SHM_DIR,
        on_new_pool: Callable[[PagePool], None] | None = None,
        on_events: Callable[[list[BlockEvent]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = safe_name(name)
        self.settings = settings
        self.shm_dir = shm_dir
        self.on_new_pool = on_new_pool
        self.on_events = on_events  # every pool's store calls it as it queues events
        self._clock = clock
        self._pools: dict[int, PagePool] = {}
        self._pins: dict[str, _Pin] = {}
        self._reserved: dict[tuple[int, int], float] = {}  # (page bytes, slot) → deadline
        self._lock = threading.Lock()

    # --- pools ------------------------------------------------------------------------------

    def recover_ssd(self) -> list[PagePool]:
        """Open the SSD files a previous run left (``<ssd path>.<page bytes>``)."""
        if not self.settings.ssd_path:
            return []
        base = Path(self.settings.ssd_path)
        found = []
        for path in sorted(base.parent.glob(base.name + ".*")):
            suffix = path.name[len(base.name) + 1 :]
            if suffix.isdigit():
                found.append(self.pool(int(suffix)))
        return found

    def pool(self, page_bytes: int) -> PagePool:
        """The pool of ``page_bytes`` pages, made on first use."""
        with self._lock:
            pool = self._pools.get(page_bytes)
            if pool is not None:
                return pool
            if len(self._pools) >= self.settings.max_arenas:
                # Each page size costs a whole host arena: a bound on what callers can make.
                sizes = ", ".join(str(b) for b in sorted(self._pools))
                raise ResourceExhausted(
                    f"this agent serves {len(self._pools)} page sizes ({sizes} bytes), the "
                    f"limit; a new one ({page_bytes} bytes) would need another host arena: "
                    "raise OMNIFLOW_KV_MAX_ARENAS"
                )
            pool = self._make(page_bytes)
            self._pools[page_bytes] = pool
        if self.on_new_pool is not None:
            self.on_new_pool(pool)
        return pool

    def _make(self, page_bytes: int) -> PagePool:
        if page_bytes <= 0:
            raise InvalidArgument(f"page_bytes must be > 0, got {page_bytes}")
        s = self.settings
        slots = s.host_bytes // page_bytes
        if slots < 1:
            raise ResourceExhausted(
                f"the host tier ({s.host_bytes} bytes) cannot hold one page of {page_bytes} "
                "bytes; raise OMNIFLOW_KV_HOST_BYTES"
            )
        shm_name = f"{self.name}-{page_bytes}"
        arena = HostArena.create(shm_name, page_bytes, slots, self.shm_dir)
        ssd = None
        try:
            if s.ssd_path:
                stride = (page_bytes + _SSD_ALIGN - 1) // _SSD_ALIGN * _SSD_ALIGN
                num_pages = s.ssd_bytes // stride
                if num_pages >= 1:
                    path = Path(f"{s.ssd_path}.{page_bytes}")
                    ssd = SsdTier(SsdFile.open(path, page_bytes, num_pages))
            store = TieredStore(HostTier(arena), ssd, self.on_events)
        except BaseException:
            arena.close()
            arena.unlink()
            raise
        log.info(
            "pool of %d-byte pages: %d host slots (%s), ssd %s",
            page_bytes,
            slots,
            arena.path,
            f"{ssd.file.num_pages} pages at {ssd.file.path}" if ssd else "off",
        )
        return PagePool(page_bytes, arena, store, shm_name)

    def all(self) -> list[PagePool]:
        with self._lock:
            return list(self._pools.values())

    def drain_events(self) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for pool in self.all():
            out += pool.store.drain_events()
        return out

    def evict(
        self,
        targets: list[tuple[PagePool, bytes]],
        hashes: list[bytes],
        tier: Tier | None,
        free_bytes: int,
    ) -> tuple[int, int]:
        """Evict ``hashes`` of each (pool, namespace) from ``tier`` (None: every tier), or
        free ``free_bytes`` of each pool's host tier; returns (demoted, dropped) pages."""
        before = [p.store.stats() for p, _ in targets]
        for pool, ns in targets:
            if hashes:
                for h in hashes:
                    pool.store.evict(ns, h, tier)
            elif free_bytes:
                pool.store.free_host(math.ceil(free_bytes / pool.page_bytes))
        after = [p.store.stats() for p, _ in targets]
        demoted = sum(a.demoted - b.demoted for a, b in zip(after, before, strict=True))
        dropped = sum(a.dropped - b.dropped for a, b in zip(after, before, strict=True))
        if hashes and tier is None:  # removed from every tier: counted as dropped
            dropped += sum(b.host_pages + b.ssd_pages - a.host_pages - a.ssd_pages
                           for a, b in zip(after, before, strict=True))  # fmt: skip
        return demoted, dropped

    # --- pins (local readers) ---------------------------------------------------------------

    def pin(self, pool: PagePool, handles: list[PageHandle], ttl_s: float) -> str:
        pin_id = uuid.uuid4().hex
        with self._lock:
            self._pins[pin_id] = _Pin(pool, handles, self._clock() + ttl_s)
        return pin_id

    def now(self) -> float:
        return self._clock()

    def deadline(self, pin_id: str) -> float:
        """When the pin lapses (NotFound when it is not held)."""
        with self._lock:
            pin = self._pins.get(pin_id)
        if pin is None:
            raise NotFound(f"pin {pin_id!r} is unknown (released already, or it lapsed)")
        return pin.deadline

    def unpin(self, pin_id: str) -> None:
        with self._lock:
            pin = self._pins.pop(pin_id, None)
        if pin is None:
            raise NotFound(f"pin {pin_id!r} is unknown (released already, or it lapsed)")
        for handle in pin.handles:
            pin.pool.store.release(handle)

    # --- reservations (local writers) -------------------------------------------------------

    def note_reserved(self, pool: PagePool, slots: list[int], ttl_s: float) -> None:
        deadline = self._clock() + ttl_s
        with self._lock:
            for slot in slots:
                self._reserved[(pool.page_bytes, slot)] = deadline

    def take_reserved(self, pool: PagePool, slot: int) -> bool:
        """Forget a reservation being committed or aborted; False if it is not held."""
        with self._lock:
            return self._reserved.pop((pool.page_bytes, slot), None) is not None

    # --- upkeep -----------------------------------------------------------------------------

    def expire(self, now: float | None = None) -> tuple[int, int]:
        """Release pins and reservations past their deadline (at ``now``, by default the
        clock's); returns (pins, reservations)."""
        now = self._clock() if now is None else now
        with self._lock:
            pins = [(k, p) for k, p in self._pins.items() if p.deadline <= now]
            for k, _ in pins:
                del self._pins[k]
            slots = [k for k, d in self._reserved.items() if d <= now]
            for k in slots:
                del self._reserved[k]
            pools = dict(self._pools)
        for pin_id, pin in pins:
            log.warning("pin %s lapsed with %d pages; released", pin_id, len(pin.handles))
            for handle in pin.handles:
                pin.pool.store.release(handle)
        for page_bytes, slot in slots:
            if pools[page_bytes].store.abort_slot(slot):
                log.warning("reservation of slot %d (%d-byte pages) lapsed", slot, page_bytes)
        return len(pins), len(slots)

    def close(self) -> None:
        """Unmap and remove every arena, close SSD files (their pages stay for a restart)."""
        for pool in self.all():
            if pool.store.ssd is not None:
                pool.store.ssd.file.close()
            pool.arena.close()
            pool.arena.unlink()
        with self._lock:
            self._pools.clear()
            self._pins.clear()
            self._reserved.clear()
