"""The pure parts of the SGLang HiCache backend: page keys, page byte order, batching.

Nothing here imports SGLang or gRPC, so it is unit-tested on any machine.

Keys. SGLang names a HiCache page by a string: ``get_hash_str`` chains
``sha256(prior page's digest ‖ tokens as little-endian u32)`` and passes the hex digest
(64 characters) to the storage backend, one key per page (sglang 0.5.x,
``python/sglang/srt/mem_cache/hicache_storage.py`` / ``utils.py``; requests without
``extra_key``/``cache_salt``, and without ``SGLANG_USE_XXH3_HASH``). The Data Flow layer
names a page by a 16-byte block hash in a namespace (DESIGN.md §4.1). SGLang hands its
storage backend only those keys, never the token ids, and runs it in its scheduler
process; the worker, in its own process, sees every request's tokens. So the worker names
each full page both ways as its tokens arrive (``PageNames``: ``sglang_page_keys`` beside
the chain's ``extend_chain``, the prompt before SGLang gets it, generated pages as they
stream) and writes key → block hash into a ``KeyTable`` file that the backend reads
(``KeyMapper``): a page SGLang stores is then named by the same block hash the built-in
and vLLM engines, the gateway and the router give it, so same-layout engines share it and
kv-aware routing sees it. A key the table does not hold (overwritten, a tenant's salted
request, whose pages the table never names, SGLang's xxh3 keys, the table not there)
keeps the older name, derived from the key with the chain's page hash
(``omniflow.kv.blocks.hash_page``: the first page of a chain in the namespace, no tokens,
``"omniflow-sglang-key-v2" ‖ key`` as its extra key): deterministic, so SGLang workers of
one model still share such pages, and never a built-in engine block hash.

Byte order. SGLang's host pool hands out a page as one flat tensor whose element order
depends on ``--hicache-mem-layout`` (``MHATokenToKVPoolHost.init_kv_buffer``):

==================== =========================================
layout               flat page order (after the K/V axis)
==================== =========================================
layer_first          layers, tokens, heads, head_dim
page_first           tokens, layers, heads, head_dim
page_first_direct    layers, tokens, heads, head_dim
page_head            heads, tokens, layers, head_dim
==================== =========================================

Pages travel in the contract order ``KVLayout.page_shape`` = (2, layers, heads, tokens,
head_dim); ``HostPageFormat`` permutes between the two.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import xxhash

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import HASH_BYTES, ROOT_PARENT, KVLayout, extend_chain, hash_page

_T = TypeVar("_T")

KEY_DOMAIN = b"omniflow-sglang-key-v2"

# Axis names of each SGLang host layout's flat page, after the leading K/V axis.
HOST_LAYOUTS: dict[str, tuple[str, str, str, str]] = {
    "layer_first": ("layer", "token", "head", "dim"),
    "page_first": ("token", "layer", "head", "dim"),
    "page_first_direct": ("layer", "token", "head", "dim"),
    "page_head": ("head", "token", "layer", "dim"),
}
_OURS = ("layer", "head", "token", "dim")

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """Our dtype name of a torch dtype (InvalidArgument for one pages cannot carry)."""
    for name, value in _TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise InvalidArgument(f"KV dtype {dtype} is not accepted; accepted: {sorted(_TORCH_DTYPES)}")


# --- keys ----------------------------------------------------------------------------------


def sglang_page_keys(tokens: Sequence[int], page_size: int, prior: str = "") -> list[str]:
    """SGLang's HiCache key of every full page of ``tokens`` (hex sha256, chained)."""
    if page_size <= 0:
        raise InvalidArgument(f"page_size must be > 0, got {page_size}")
    keys: list[str] = []
    digest = bytes.fromhex(prior) if prior else b""
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        h = hashlib.sha256(digest)
        for t in tokens[start : start + page_size]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        digest = h.digest()
        keys.append(digest.hex())
    return keys


_TABLE_MAGIC = b"OFSGKEY1"
_HEADER = struct.Struct("<8sI4x16s")  # magic, slots, namespace
_SLOT = struct.Struct("<32s16s8s")  # SGLang key (sha256), block hash, xxh3_64 of the two
KEY_TABLE_SLOTS = 1 << 16  # 3.5 MiB: the pages of the last ~1M tokens a worker saw


class KeyTable:
    """SGLang page keys → the chain's block hashes of the same pages, in one file.

    The worker (which knows a request's tokens) writes; SGLang's scheduler processes (whose
    storage backend gets only keys) read, each through its own mapping of the file. One
    slot per key, direct-mapped by the key's first bytes: a newer key overwrites an older
    one, whose page then falls back to ``KeyMapper``'s key-derived name (a miss, never a
    wrong page). Each slot carries a checksum of its key and hash, so a slot read while
    the writer rewrites it is a miss too."""

    def __init__(self, path: Path, *, namespace: bytes | None = None, slots: int = 0) -> None:
        """Open ``path``; with ``namespace``, create it (``slots`` slots, or the default)."""
        self.path = Path(path)
        if namespace is not None:
            if len(namespace) != HASH_BYTES:
                raise InvalidArgument(f"namespace must be {HASH_BYTES} bytes")
            slots = slots or KEY_TABLE_SLOTS
            with open(self.path, "wb") as f:
                f.write(_HEADER.pack(_TABLE_MAGIC, slots, namespace))
                f.truncate(_HEADER.size + slots * _SLOT.size)
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        magic, self.slots, self.namespace = _HEADER.unpack_from(self._map, 0)
        if magic != _TABLE_MAGIC or len(self._map) != _HEADER.size + self.slots * _SLOT.size:
            self._map.close()
            raise InvalidArgument(f"{self.path} is not an SGLang key table")
        self._lock = threading.Lock()

    def _offset(self, key: bytes) -> int:
        return _HEADER.size + int.from_bytes(key[:8], "little") % self.slots * _SLOT.size

    def put(self, key: bytes, block_hash: bytes) -> None:
        check = xxhash.xxh3_64_digest(key + block_hash)
        with self._lock:
            _SLOT.pack_into(self._map, self._offset(key), key, block_hash, check)

    def get(self, key: bytes) -> bytes | None:
        """The block hash recorded for the 32-byte ``key``, or None."""
        got, block_hash, check = _SLOT.unpack_from(self._map, self._offset(key))
        if got != key or check != xxhash.xxh3_64_digest(key + block_hash):
            return None
        return block_hash

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


def key_table_path(folder: Path | str, namespace: bytes) -> Path:
    """Where the key table of ``namespace`` lies in the worker's table folder."""
    return Path(folder) / f"{namespace.hex()}.keys"


@dataclass(slots=True)
class PageNames:
    """One sequence's full pages named both ways as its tokens arrive: SGLang's key and the
    chain's block hash (``extend_chain``, no extra keys), each pair put in ``table``."""

    table: KeyTable
    page_size: int
    chain: list[bytes] = field(default_factory=list)
    key: str = ""  # the last full page's SGLang key

    def extend(self, tokens: Sequence[int]) -> int:
        """Record the pages of ``tokens`` (the whole sequence so far) not recorded yet;
        how many were new."""
        done = len(self.chain)
        new = extend_chain(self.chain, self.table.namespace, tokens, self.page_size)
        rest = tokens[done * self.page_size : len(self.chain) * self.page_size]
        keys = sglang_page_keys(rest, self.page_size, prior=self.key)
        for key, block_hash in zip(keys, new, strict=True):
            self.table.put(bytes.fromhex(key), block_hash)
        if keys:
            self.key = keys[-1]
        return len(new)


@dataclass(frozen=True, slots=True)
class KeyMapper:
    """SGLang page keys → 16-byte block hashes of one namespace: the chain's block hash of
    the page when ``table`` has the key, else a name derived from the key alone."""

    namespace: bytes
    table: KeyTable | None = None

    def __post_init__(self) -> None:
        if len(self.namespace) != HASH_BYTES:
            raise InvalidArgument(
                f"namespace must be {HASH_BYTES} bytes, got {len(self.namespace)}"
            )

    def block_hash(self, key: str) -> bytes:
        if not key:
            raise InvalidArgument("an SGLang page key must not be empty")
        if self.table is not None and len(key) == 64:
            try:
                named = self.table.get(bytes.fromhex(key))
            except ValueError:  # not hex: never a sha256 key of ours
                named = None
            if named is not None:
                return named
        # A page of no tokens whose extra key is the SGLang key, first in its chain.
        return hash_page(ROOT_PARENT, self.namespace, (), KEY_DOMAIN + key.encode())

    def block_hashes(self, keys: Sequence[str]) -> list[bytes]:
        return [self.block_hash(k) for k in keys]

    def prompt_hashes(self, tokens: Sequence[int], page_size: int) -> list[bytes]:
        """Block hashes the pages of ``tokens`` get when SGLang stores them through us
        and no table names them."""
        return self.block_hashes(sglang_page_keys(tokens, page_size))


# --- page byte order -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostPageFormat:
    """One SGLang host-pool page: its layout name and sizes (per tensor-parallel rank)."""

    layout: str
    num_layers: int
    num_heads: int
    page_size: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.layout not in HOST_LAYOUTS:
            raise InvalidArgument(
                f"HiCache layout {self.layout!r} is not accepted; accepted: {sorted(HOST_LAYOUTS)}"
            )
        if self.dtype not in _TORCH_DTYPES:
            raise InvalidArgument(
                f"KV dtype {self.dtype!r} is not accepted; accepted: {sorted(_TORCH_DTYPES)}"
            )
        for name in ("num_layers", "num_heads", "page_size", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return 2 * self.num_layers * self.num_heads * self.page_size * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def _sizes(self) -> dict[str, int]:
        return {
            "layer": self.num_layers,
            "head": self.num_heads,
            "token": self.page_size,
            "dim": self.head_dim,
        }

    @property
    def host_shape(self) -> tuple[int, ...]:
        sizes = self._sizes()
        return (2, *(sizes[a] for a in HOST_LAYOUTS[self.layout]))

    def kv_layout(self, model_id: str, lora_id: str = "") -> KVLayout:
        """The namespace layout of these pages (our byte order, same sizes)."""
        return KVLayout(
            model_id=model_id,
            num_layers=self.num_layers,
            num_kv_heads=self.num_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=self.page_size,
            lora_id=lora_id,
        )

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if t.numel() * t.element_size() != self.page_bytes:
            raise InvalidArgument(
                f"{what} is {t.numel() * t.element_size()} bytes; a page of {self} is "
                f"{self.page_bytes}"
            )
        return t

    def to_contract(self, flat: torch.Tensor) -> torch.Tensor:
        """A host-layout flat page → a contiguous uint8 CPU tensor in ``KVLayout.page_shape``
        order (one permuting copy)."""
        self._check(flat, "the SGLang page")
        src = HOST_LAYOUTS[self.layout]
        page = flat.reshape(-1).view(self.torch_dtype).reshape(self.host_shape)
        perm = (0, *(1 + src.index(a) for a in _OURS))
        return page.permute(perm).contiguous().cpu().view(torch.uint8).reshape(-1)

    def from_contract(
        self, data: torch.Tensor | np.ndarray | bytes | bytearray | memoryview
    ) -> torch.Tensor:
        """Page bytes in contract order → a contiguous flat tensor of ``dtype`` in the host
        layout (what ``set_from_flat_data_page`` takes)."""
        if isinstance(data, np.ndarray):
            data = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        elif not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._check(data, "the stored page")
        sizes = self._sizes()
        ours = data.reshape(-1).view(torch.uint8).view(self.torch_dtype)
        ours = ours.reshape(2, *(sizes[a] for a in _OURS))
        dst = HOST_LAYOUTS[self.layout]
        perm = (0, *(1 + _OURS.index(a) for a in dst))
        return ours.permute(perm).contiguous().reshape(-1)


def host_format_of(pool: object, tp_size: int = 1) -> HostPageFormat:
    """The page format of an SGLang MHA host pool (``mem_pool_host``), read from its fields."""
    layout = getattr(pool, "layout", None)
    fields = ("layer_num", "head_num", "page_size", "head_dim", "dtype")
    missing = [f for f in fields if not hasattr(pool, f)]
    if layout is None or missing:
        raise InvalidArgument(
            f"the host pool {type(pool).__name__} lacks {missing or ['layout']}: only MHA "
            "host pools (not MLA or hybrid) can be stored through the kv-agent"
        )
    return HostPageFormat(
        layout=str(layout),
        num_layers=int(pool.layer_num),  # type: ignore[attr-defined]
        num_heads=int(pool.head_num),  # type: ignore[attr-defined]
        page_size=int(pool.page_size),  # type: ignore[attr-defined]
        head_dim=int(pool.head_dim),  # type: ignore[attr-defined]
        dtype=dtype_name(pool.dtype),  # type: ignore[attr-defined]
    )


def namespace_model_id(model_id: str, tp_rank: int, tp_size: int) -> str:
    """The model id of one rank's pages: a rank of a tensor-parallel group holds only its
    heads, so each rank is a namespace of its own; a single GPU keeps the plain id."""
    return model_id if tp_size <= 1 else f"{model_id}@tp{tp_rank}of{tp_size}"


# --- batching ------------------------------------------------------------------------------


def batched(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    """Consecutive slices of at most ``size`` items."""
    if size <= 0:
        raise InvalidArgument(f"batch size must be > 0, got {size}")
    for start in range(0, len(items), size):
        yield items[start : start + size]


def leading_run(flags: Sequence[bool]) -> int:
    """How many leading entries are True (HiCache counts hits as a prefix)."""
    for i, ok in enumerate(flags):
        if not ok:
            return i
    return len(flags)
