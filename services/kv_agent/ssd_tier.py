"""SSD tier: a preallocated file of fixed-size pages with its own allocator.

File layout (every region 4 KiB aligned, so pages can later be read with O_DIRECT):

- header (4 KiB): magic ``OFKVSSD1``, version, page bytes, page count, stride, data offset;
- record table: one 64-byte record per page slot — state (1 = holds a page), namespace,
  block hash, page checksum (xxh3_64), write generation, and an xxh3_64 of the record
  itself so a torn record write is recognised and the slot treated as free;
- data: ``num_pages`` slots of ``stride`` bytes (page bytes rounded up to 4 KiB).

A page is written data first, record second, with ``os.pwrite``; read with
``os.preadv`` straight into the caller's buffer and verified against its checksum. On
open, valid records are read back so an agent restarted on the same file re-announces its
pages (LRU order restored from the write generation).
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np
import xxhash

from omniflow.errors import DataLoss, FailedPrecondition, InvalidArgument
from omniflow.kv.checksum import page_checksum
from omniflow_services.kv_agent.host_tier import SlotAllocator
from omniflow_services.kv_agent.page_table import PageTable

log = logging.getLogger(__name__)

SSD_MAGIC = b"OFKVSSD1"
_ALIGN = 4096
_HEADER = struct.Struct("<8sIQQQQ")  # magic, version, page_bytes, num_pages, stride, data_off
_RECORD = struct.Struct("<B7x16s16sQQ")  # state, namespace, hash, checksum, generation
RECORD_BYTES = 64
_FREE_RECORD = bytes(RECORD_BYTES)


def _align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(slots=True)
class SsdPage:
    slot: int
    checksum: int
    generation: int
    pins: int = 0


class SsdFile:
    """The page file itself: positioned I/O of pages and their records."""

    def __init__(self, path: Path, fd: int, page_bytes: int, num_pages: int) -> None:
        self.path = path
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.stride = _align(page_bytes)
        self.data_offset = _align(_ALIGN + RECORD_BYTES * num_pages)
        self._fd = fd

    @classmethod
    def open(cls, path: Path, page_bytes: int, num_pages: int) -> Self:
        """Open the file, creating and preallocating it if absent.

        An existing file with another page size or count raises FailedPrecondition: its
        pages cannot be reused, and silently overwriting them would hide a config mistake.
        """
        if page_bytes <= 0 or num_pages <= 0:
            raise InvalidArgument(
                f"page_bytes and num_pages must be > 0, got {page_bytes} and {num_pages}"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            ssd = cls(path, fd, page_bytes, num_pages)
            header = os.pread(fd, _HEADER.size, 0)
            if len(header) < _HEADER.size or header[:8] != SSD_MAGIC:
                size = ssd.data_offset + ssd.stride * num_pages
                os.ftruncate(fd, 0)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:  # tmpfs and some filesystems: a sparse file still works
                    os.ftruncate(fd, size)
                os.pwrite(fd, bytes(ssd.data_offset), 0)
                os.pwrite(
                    fd,
                    _HEADER.pack(SSD_MAGIC, 1, page_bytes, num_pages, ssd.stride, ssd.data_offset),
                    0,
                )
                os.fsync(fd)
                log.info("ssd tier %s: created, %d pages of %d bytes", path, num_pages, page_bytes)
            else:
                _, version, pb, n, _, _ = _HEADER.unpack(header)
                if (version, pb, n) != (1, page_bytes, num_pages):
                    raise FailedPrecondition(
                        f"{path} holds {n} pages of {pb} bytes (v{version}); configured "
                        f"{num_pages} pages of {page_bytes} bytes: move the file or fix the config"
                    )
        except BaseException:
            os.close(fd)
            raise
        return ssd

    def _page_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.stride

    def read_records(self) -> dict[int, tuple[bytes, bytes, int, int]]:
        """Valid records: slot → (namespace, block hash, checksum, generation)."""
        raw = os.pread(self._fd, RECORD_BYTES * self.num_pages, _ALIGN)
        out: dict[int, tuple[bytes, bytes, int, int]] = {}
        for slot in range(self.num_pages):
            rec = raw[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES]
            if rec[0] != 1:
                continue
            if xxhash.xxh3_64_intdigest(rec[:56]) != int.from_bytes(rec[56:], "little"):
                log.warning("ssd tier %s: torn record at slot %d, slot freed", self.path, slot)
                continue
            _, ns, block_hash, checksum, gen = _RECORD.unpack(rec[:56])
            out[slot] = (ns, block_hash, checksum, gen)
        return out

    def write_page(self, slot: int, data: np.ndarray | bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes != self.page_bytes:
            raise InvalidArgument(f"page is {view.nbytes} bytes; this file holds {self.page_bytes}")
        written = os.pwrite(self._fd, view, self._page_offset(slot))
        if written != self.page_bytes:
            raise OSError(f"short write of page slot {slot}: {written} of {self.page_bytes}")

    def write_record(
        self, slot: int, ns: bytes, block_hash: bytes, checksum: int, gen: int
    ) -> None:
        body = _RECORD.pack(1, ns, block_hash, checksum, gen)
        rec = body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
        os.pwrite(self._fd, rec, _ALIGN + slot * RECORD_BYTES)

    def clear_record(self, slot: int) -> None:
        os.pwrite(self._fd, _FREE_RECORD, _ALIGN + slot * RECORD_BYTES)

    def read_page_into(self, slot: int, out: np.ndarray | memoryview | bytearray) -> None:
        """Read one page straight into ``out`` (``page_bytes`` long) with one preadv."""
        view = memoryview(out).cast("B")
        got = os.preadv(self._fd, [view], self._page_offset(slot))
        if got != self.page_bytes:
            raise DataLoss(f"short read of page slot {slot}: {got} of {self.page_bytes} bytes")

    def prefetch(self, slots: list[int]) -> None:
        """Ask the kernel to start reading these pages now (async readahead)."""
        for slot in slots:
            os.posix_fadvise(
                self._fd, self._page_offset(slot), self.page_bytes, os.POSIX_FADV_WILLNEED
            )

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SsdTier(PageTable[SsdPage]):
    """Page table over an ``SsdFile``: key → slot, LRU order, pins, a budget.

    Keys are ``namespace + block_hash``. Not thread-safe: the store locks.
    """

    label = "ssd page"

    def __init__(self, file: SsdFile, budget_pages: int | None = None) -> None:
        super().__init__()
        self.file = file
        self.budget_pages = min(budget_pages or file.num_pages, file.num_pages)
        records = file.read_records()
        for slot, (ns, block_hash, checksum, gen) in sorted(records.items(), key=lambda r: r[1][3]):
            key = ns + block_hash
            old = self._pages.pop(key, None)
            if old is not None:  # the same page twice (a crash between writes): keep newest
                file.clear_record(old.slot)
                records.pop(old.slot)
            self._pages[key] = SsdPage(slot, checksum, gen)
        self._alloc = SlotAllocator(file.num_pages, used=set(records))
        self._gen = max((p.generation for p in self._pages.values()), default=0)
        if self._pages:
            log.info("ssd tier %s: recovered %d pages", file.path, len(self._pages))

    @property
    def full(self) -> bool:
        return len(self._pages) >= self.budget_pages

    def write(self, key: bytes, data: np.ndarray | bytes | memoryview, checksum: int) -> SsdPage:
        """Store a page in a free slot; the caller made room (``full`` is False)."""
        slot = self._alloc.alloc() if not self.full else None
        if slot is None:
            raise FailedPrecondition("ssd tier is full; evict first")
        try:
            self.file.write_page(slot, data)
            self._gen += 1
            self.file.write_record(slot, key[:16], key[16:], checksum, self._gen)
        except BaseException:
            self._alloc.free(slot)
            raise
        return self._put(key, SsdPage(slot, checksum, self._gen))

    def read_into(self, key: bytes, out: np.ndarray | memoryview | bytearray) -> None:
        """Read and verify a page; on a checksum mismatch the page is dropped (DataLoss)."""
        page = self._pages[key]
        self.file.read_page_into(page.slot, out)
        got = page_checksum(out)
        if got != page.checksum:
            self.remove(key, force=True)
            raise DataLoss(
                f"ssd page {key[16:].hex()} failed its checksum "
                f"(stored {page.checksum:016x}, read {got:016x}); dropped"
            )

    def remove(self, key: bytes, force: bool = False) -> SsdPage:
        page = self._take(key, force)
        self.file.clear_record(page.slot)
        self._alloc.free(page.slot)
        return page
