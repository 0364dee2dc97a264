"""Large intermediate tensors (embeddings, latents, audio) held by the agent as TensorRefs.

Each tensor lives in its own file in ``/dev/shm`` (``omniflow-<store>-t-<ref id>``), so a
worker on the node maps it by name (``map_tensor``) and reads it in place; another node
gets its bytes through the agents. A tensor has a time to live and a checksum; the store
keeps a byte budget, and an expired or unknown reference is NotFound.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omniflow.errors import InvalidArgument, NotFound, ResourceExhausted
from omniflow.kv.arena import DEFAULT_SHM_DIR, arena_path
from omniflow.kv.checksum import page_checksum, verify_checksum

log = logging.getLogger(__name__)

# Element sizes of dtypes numpy lacks; the rest come from numpy.
_EXTRA_DTYPES = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_itemsize(dtype: str) -> int:
    if dtype in _EXTRA_DTYPES:
        return _EXTRA_DTYPES[dtype]
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        raise InvalidArgument(
            f"dtype {dtype!r} is unknown; use a numpy dtype name or one of {sorted(_EXTRA_DTYPES)}"
        ) from None


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A handle to a tensor held by an agent; travels in workflow messages instead of bytes."""

    ref_id: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    checksum: int  # xxh3_64 of the bytes
    expires_at: float  # unix time
    shm_name: str  # arena-style name a local process passes to ``map_tensor``


def map_tensor(ref: TensorRef, directory: Path = DEFAULT_SHM_DIR) -> np.ndarray:
    """Map a tensor another process on this node stored; a read-only uint8 or typed array.

    bfloat16/float8 tensors come back as raw uint8 (numpy has no such dtype).
    """
    path = arena_path(ref.shm_name, directory)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), ref.nbytes, prot=mmap.PROT_READ) if ref.nbytes else None
    except FileNotFoundError:
        raise NotFound(
            f"tensor {ref.ref_id} is not held on this node (expired or unknown)"
        ) from None
    raw = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.empty(0, np.uint8)
    if ref.dtype in _EXTRA_DTYPES:
        return raw
    return raw.view(np.dtype(ref.dtype)).reshape(ref.shape)


@dataclass(slots=True)
class _Held:
    ref: TensorRef
    path: Path


class TensorStore:
    """Tensors of one agent, under a byte budget, each with a TTL."""

    def __init__(
        self,
        store_name: str,
        budget_bytes: int,
        *,
        default_ttl_s: float = 300.0,
        max_ttl_s: float = 3600.0,
        directory: Path = DEFAULT_SHM_DIR,
        clock: Callable[[], float] = time.time,
    ) -> None:
        arena_path(store_name, directory)  # validates the name
        self.store_name = store_name
        self.budget_bytes = budget_bytes
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.directory = directory
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._held)

    def put(
        self,
        data: np.ndarray | bytes | bytearray | memoryview,
        *,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
        ttl_s: float | None = None,
        checksum: int | None = None,
    ) -> TensorRef:
        """Store a tensor (one copy into shared memory); shape/dtype default to the array's.

        ``checksum``, if given, is verified first (DataLoss on mismatch, nothing stored).
        """
        if isinstance(data, np.ndarray):
            arr = np.ascontiguousarray(data)
            shape = tuple(arr.shape) if shape is None else tuple(shape)
            dtype = dtype or arr.dtype.name
            raw = arr.reshape(-1).view(np.uint8)
        else:
            if shape is None or dtype is None:
                raise InvalidArgument("raw bytes need an explicit shape and dtype")
            raw = np.frombuffer(data, dtype=np.uint8)
            shape = tuple(shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"shape {shape} has a negative dimension")
        nbytes = math.prod(shape) * dtype_itemsize(dtype)
        if nbytes != raw.size:
            raise InvalidArgument(f"shape {shape} of {dtype} is {nbytes} bytes; got {raw.size}")
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= self.max_ttl_s:
            raise InvalidArgument(f"ttl_s must be in (0, {self.max_ttl_s}], got {ttl}")
        if checksum is not None:
            verify_checksum(raw, checksum, "tensor")
        self.sweep()
        with self._lock:
            if self._used + nbytes > self.budget_bytes:
                raise ResourceExhausted(
                    f"tensor of {nbytes} bytes does not fit: {self._used} of "
                    f"{self.budget_bytes} bytes in use"
                )
            self._used += nbytes
        ref_id = uuid.uuid4().hex
        shm_name = f"{self.store_name}-t-{ref_id}"
        path = arena_path(shm_name, self.directory)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                if nbytes:
                    os.ftruncate(fd, nbytes)
                    with mmap.mmap(fd, nbytes) as mm:
                        np.copyto(np.frombuffer(mm, dtype=np.uint8), raw)
            finally:
                os.close(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            with self._lock:
                self._used -= nbytes
            raise
        ref = TensorRef(
            ref_id=ref_id,
            shape=shape,
            dtype=dtype,
            nbytes=nbytes,
            checksum=checksum if checksum is not None else page_checksum(raw),
            expires_at=self._clock() + ttl,
            shm_name=shm_name,
        )
        with self._lock:
            self._held[ref_id] = _Held(ref, path)
        return ref

    def lookup(self, ref_id: str) -> TensorRef:
        """The reference, if held and not expired; NotFound otherwise."""
        with self._lock:
            held = self._held.get(ref_id)
        if held is None or held.ref.expires_at <= self._clock():
            raise NotFound(f"tensor {ref_id!r} is unknown or expired")
        return held.ref

    def view(self, ref_id: str) -> np.ndarray:
        """A read-only view in place (numpy dtype, or raw uint8 for bfloat16/float8)."""
        return map_tensor(self.lookup(ref_id), self.directory)

    def read_bytes(self, ref_id: str, verify: bool = True) -> bytes:
        """A copy of the bytes, checksum verified (for the network path)."""
        ref = self.lookup(ref_id)
        data = map_tensor(ref, self.directory).reshape(-1).view(np.uint8).tobytes()
        if verify:
            verify_checksum(data, ref.checksum, f"tensor {ref_id}")
        return data

    def delete(self, ref_id: str) -> bool:
        with self._lock:
            held = self._held.pop(ref_id, None)
            if held is None:
                return False
            self._used -= held.ref.nbytes
        held.path.unlink(missing_ok=True)
        return True

    def sweep(self) -> int:
        """Delete expired tensors; returns how many."""
        now = self._clock()
        with self._lock:
            expired = [r for r, h in self._held.items() if h.ref.expires_at <= now]
        for ref_id in expired:
            self.delete(ref_id)
        if expired:
            log.info("tensor store %s: %d expired", self.store_name, len(expired))
        return len(expired)

    def close(self) -> None:
        """Delete every tensor (the agent is going away)."""
        with self._lock:
            ids = list(self._held)
        for ref_id in ids:
            self.delete(ref_id)
