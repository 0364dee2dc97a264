"""The host tier's arena file: a shared-memory file of fixed-size page slots.

The file format is shared by the node's kv-agent, which creates the arena and owns the
allocation of its slots (``omniflow_services.kv_agent.host_tier``), and by the workers of
the node, which ``attach`` by name and read or write a slot in place: one memcpy through a
numpy view, no serialisation. It lives in the library because both sides map it.

The arena is a file in ``/dev/shm`` mapped with ``mmap`` (not
``multiprocessing.shared_memory``, whose resource tracker would unlink the segment when
any attaching process exits).

File layout: a 4 KiB header (magic, version, page bytes, slot count, slot stride), then
``num_slots`` slots of ``stride`` bytes (page bytes rounded up to 64, cache-line aligned).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
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
