"""Host tier: a shared-memory arena of fixed-size page slots, and the agent's page table.

The arena is a file in ``/dev/shm`` mapped with ``mmap`` (not
``multiprocessing.shared_memory``, whose resource tracker would unlink the segment when
any attaching process exits). The agent creates it; workers on the node ``attach`` by name
and read or write a slot in place: one memcpy through a numpy view, no serialisation.

File layout: a 4 KiB header (magic, version, page bytes, slot count, slot stride), then
``num_slots`` slots of ``stride`` bytes (page bytes rounded up to 64, cache-line aligned).
Only the agent process allocates slots and owns the page table.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from omniflow.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)

ARENA_MAGIC = b"OFKVARN1"
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIQQQ")  # magic, version, page_bytes, num_slots, stride
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
DEFAULT_SHM_DIR = Path("/dev/shm")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def arena_path(name: str, directory: Path = DEFAULT_SHM_DIR) -> Path:
    if not _NAME.match(name):
        raise InvalidArgument(f"arena name {name!r} must be 1-100 characters of [A-Za-z0-9._-]")
    return directory / f"omniflow-{name}"


class HostArena:
    """A mapped arena of ``num_slots`` page slots of ``page_bytes`` each."""

    def __init__(self, path: Path, fd: int, page_bytes: int, num_slots: int, stride: int) -> None:
        self.path = path
        self.page_bytes = page_bytes
        self.num_slots = num_slots
        self.stride = stride
        self._fd = fd
        self._mm: mmap.mmap | None = mmap.mmap(fd, HEADER_BYTES + stride * num_slots)
        self._buf: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)

    @classmethod
    def create(
        cls, name: str, page_bytes: int, num_slots: int, directory: Path = DEFAULT_SHM_DIR
    ) -> Self:
        """Create (or replace) the arena file; the creator is responsible for ``unlink``."""
        if page_bytes <= 0 or num_slots <= 0:
            raise InvalidArgument(
                f"page_bytes and num_slots must be > 0, got {page_bytes} and {num_slots}"
            )
        path = arena_path(name, directory)
        stride = _align(page_bytes, 64)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + stride * num_slots)
            os.pwrite(fd, _HEADER.pack(ARENA_MAGIC, 1, page_bytes, num_slots, stride), 0)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        log.info("host arena %s: %d slots of %d bytes", path, num_slots, page_bytes)
        return cls(path, fd, page_bytes, num_slots, stride)

    @classmethod
    def attach(cls, name: str, directory: Path = DEFAULT_SHM_DIR) -> Self:
        """Map an arena another process created on this node."""
        path = arena_path(name, directory)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound(f"no host arena {name!r} at {path}") from None
        header = os.pread(fd, _HEADER.size, 0)
        magic, version, page_bytes, num_slots, stride = _HEADER.unpack(header)
        if magic != ARENA_MAGIC or version != 1:
            os.close(fd)
            raise FailedPrecondition(f"{path} is not an omniflow host arena (v1)")
        return cls(path, fd, page_bytes, num_slots, stride)

    def _check(self, slot: int) -> np.ndarray:
        if self._buf is None:
            raise FailedPrecondition(f"host arena {self.path} is closed")
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"slot {slot} out of range [0, {self.num_slots})")
        return self._buf

    def view(self, slot: int) -> np.ndarray:
        """A writable uint8 view of one slot (``page_bytes`` long), in place."""
        buf = self._check(slot)
        start = HEADER_BYTES + slot * self.stride
        return buf[start : start + self.page_bytes]

    def write(self, slot: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Copy one page into a slot (one memcpy)."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        src = src.reshape(-1).view(np.uint8)
        if src.size != self.page_bytes:
            raise InvalidArgument(f"page is {src.size} bytes; this arena holds {self.page_bytes}")
        np.copyto(self.view(slot), src)

    def read_into(self, slot: int, out: np.ndarray | memoryview | bytearray) -> None:
        """Copy one slot into caller memory of exactly ``page_bytes`` (one memcpy)."""
        dst = out if isinstance(out, np.ndarray) else np.frombuffer(out, dtype=np.uint8)
        np.copyto(dst.reshape(-1).view(np.uint8), self.view(slot))

    def close(self) -> None:
        """Unmap; views handed out must be dropped first, or the mapping lives until they are."""
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                log.warning("host arena %s: views still alive; unmapped when they go", self.path)
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_slots - len(self._free)


@dataclass(slots=True)
class HostPage:
    """A page in the host arena; ``pins`` > 0 means a reader or a transfer holds it."""

    slot: int
    checksum: int
    pins: int = 0


class HostTier:
    """The agent's page table over an arena: key → slot, LRU order, pin counts, a budget.

    Keys are ``namespace + block_hash`` (32 bytes). Not thread-safe: the store locks.
    """

    def __init__(self, arena: HostArena, budget_pages: int | None = None) -> None:
        self.arena = arena
        self.budget_pages = min(budget_pages or arena.num_slots, arena.num_slots)
        self._alloc = SlotAllocator(arena.num_slots)
        self._pages: OrderedDict[bytes, HostPage] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def get(self, key: bytes, touch: bool = True) -> HostPage | None:
        page = self._pages.get(key)
        if page is not None and touch:
            self._pages.move_to_end(key)
        return page

    def reserve_slot(self) -> int | None:
        """A slot for a new page, or None when the budget or the arena is full."""
        if self._alloc.used_count >= self.budget_pages:
            return None
        return self._alloc.alloc()

    def release_slot(self, slot: int) -> None:
        self._alloc.free(slot)

    def insert(self, key: bytes, slot: int, checksum: int, pins: int = 0) -> HostPage:
        page = HostPage(slot, checksum, pins)
        self._pages[key] = page
        return page

    def remove(self, key: bytes) -> HostPage:
        page = self._pages.pop(key)
        if page.pins:
            self._pages[key] = page
            raise FailedPrecondition(f"page {key.hex()} is pinned ({page.pins})")
        self._alloc.free(page.slot)
        return page

    def lru_victim(self) -> bytes | None:
        """The least recently used unpinned page, or None if every page is pinned."""
        for key, page in self._pages.items():
            if not page.pins:
                return key
        return None

    def keys(self) -> list[bytes]:
        return list(self._pages)

    @property
    def reserved_slots(self) -> int:
        """Slots allocated but not (yet) in the table: reservations in flight."""
        return self._alloc.used_count - len(self._pages)
