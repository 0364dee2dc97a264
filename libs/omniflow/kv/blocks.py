"""Block identity (DESIGN.md §4.1): the chained xxh3_128 hash of KV pages.

``block_hash[i] = xxh3_128(parent ‖ namespace ‖ tokens_i as little-endian u32 ‖ extra_i)``
with ``parent = 16 zero bytes`` for the first page. Only full pages get a hash: the
partial tail page of a request stays private to the worker that holds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from omniflow.errors import InvalidArgument

HASH_BYTES = 16
ROOT_PARENT = bytes(HASH_BYTES)
DEFAULT_PAGE_SIZE = 16

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class BlockIdentityError(ValueError):
    """A layout or token list that cannot produce block hashes."""


def check_hash(value: bytes, what: str = "block hash") -> bytes:
    """``value`` if it is a 16-byte block hash; else InvalidArgument naming ``what``. The one
    block-hash length check of the worker, the agent, the index and their clients."""
    if len(value) != HASH_BYTES:
        raise InvalidArgument(f"{what} has {len(value)} bytes; block hashes are {HASH_BYTES} bytes")
    return value


def check_namespace(namespace: bytes) -> bytes:
    """``namespace`` if it is 16 bytes (a layout fingerprint); else InvalidArgument."""
    if len(namespace) != HASH_BYTES:
        raise InvalidArgument(f"namespace must be {HASH_BYTES} bytes, got {len(namespace)}")
    return namespace


def check_hashes(hashes: Sequence[bytes], limit: int | None = None) -> list[bytes]:
    """The hashes as a list, each 16 bytes, at most ``limit`` of them (InvalidArgument)."""
    if limit is not None and len(hashes) > limit:
        raise InvalidArgument(f"at most {limit} block hashes per request, got {len(hashes)}")
    out = list(hashes)
    for i, h in enumerate(out):
        check_hash(h, f"block hash {i}")
    return out


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a KV page looks like in memory; two layouts that differ never share a block."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    page_size: int = DEFAULT_PAGE_SIZE
    lora_id: str = ""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise BlockIdentityError("model_id must not be empty")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise BlockIdentityError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_BYTES:
            raise BlockIdentityError(
                f"dtype {self.dtype!r} is not supported; accepted: {sorted(_DTYPE_BYTES)}"
            )

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Element order of one page's bytes: ``(2 [K, V], layers, kv_heads, page_size, head_dim)``.

        Elements are native little-endian ``dtype``. Every producer and consumer of raw page
        bytes (worker pools, agents, connectors) uses this order.
        """
        return (2, self.num_layers, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V, for every layer, for ``page_size`` tokens."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return per_token * self.page_size

    def fingerprint(self) -> bytes:
        """Canonical bytes of the layout, hashed into every block of this namespace."""
        text = (
            f"omniflow-kv-v1|model={self.model_id}|layers={self.num_layers}"
            f"|kv_heads={self.num_kv_heads}|head_dim={self.head_dim}|dtype={self.dtype}"
            f"|page={self.page_size}|lora={self.lora_id}"
        )
        return text.encode()

    @property
    def namespace(self) -> bytes:
        """16-byte namespace id: xxh3_128 of the fingerprint."""
        return xxhash.xxh3_128_digest(self.fingerprint())

    @property
    def namespace_hex(self) -> str:
        return self.namespace.hex()


def encode_extra_keys(extra: Sequence[tuple[bytes, int]]) -> bytes:
    """Serialise a page's multimodal extra keys: each (16-byte item id, u32 offset)."""
    out = bytearray()
    for item_id, offset in extra:
        if len(item_id) != HASH_BYTES:
            raise BlockIdentityError(f"item id must be {HASH_BYTES} bytes, got {len(item_id)}")
        out += item_id + int(offset).to_bytes(4, "little")
    return bytes(out)


def item_id(raw: bytes) -> bytes:
    """Id of a multimodal item (image, audio clip): xxh3_128 of its raw bytes."""
    return xxhash.xxh3_128_digest(raw)


def hash_page(parent: bytes, namespace: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full page given its parent's hash."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise BlockIdentityError("token ids must fit in an unsigned 32-bit integer")
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(namespace)
    h.update(arr.astype("<u4").tobytes())
    h.update(extra)
    return h.digest()


def extend_chain(
    chain: list[bytes],
    namespace: bytes,
    tokens: Sequence[int],
    page_size: int = DEFAULT_PAGE_SIZE,
    extra: Mapping[int, bytes] | None = None,
    *,
    pages: int | None = None,
    parent: bytes = ROOT_PARENT,
) -> list[bytes]:
    """Extend ``chain`` in place to the hashes of more full pages of ``tokens``; return the
    new ones. The one hashing loop of block identity: every chain is built here.

    ``tokens`` is the whole sequence from page 0 and ``chain`` the hashes of its first
    ``len(chain)`` pages (a caller keeps the list and extends it as tokens arrive, hashing
    each page once). ``pages`` caps the chain's length (default: every full page);
    ``extra`` maps a page index to its encoded extra keys (``encode_extra_keys``, the
    tenant salt); ``parent`` is the hash before page 0 (the root for a whole sequence).
    """
    if page_size <= 0:
        raise BlockIdentityError(f"page_size must be > 0, got {page_size}")
    if len(namespace) != HASH_BYTES:
        raise BlockIdentityError(f"namespace must be {HASH_BYTES} bytes, got {len(namespace)}")
    full = len(tokens) // page_size
    stop = full if pages is None else min(pages, full)
    first = len(chain)
    last = chain[-1] if chain else parent
    for i in range(first, stop):
        page_extra = extra.get(i, b"") if extra else b""
        last = hash_page(last, namespace, tokens[i * page_size : (i + 1) * page_size], page_extra)
        chain.append(last)
    return chain[first:]


def block_hashes(
    namespace: bytes,
    tokens: Sequence[int],
    page_size: int = DEFAULT_PAGE_SIZE,
    extra_keys: Mapping[int, bytes] | None = None,
    parent: bytes = ROOT_PARENT,
) -> list[bytes]:
    """Hashes of every full page of ``tokens``; the partial tail page has none.

    ``extra_keys`` maps a page index to its encoded extra keys (``encode_extra_keys``).
    The one-shot form of ``extend_chain``.
    """
    return extend_chain([], namespace, tokens, page_size, extra_keys, parent=parent)


# --- multimodal items ------------------------------------------------------------------------

#: Pad ids have the top bit set, so they never equal a real vocabulary id (all < 2**31).
PAD_ID_FLAG = 0x8000_0000


@dataclass(frozen=True, slots=True)
class MultimodalSpan:
    """A multimodal item's placeholder tokens: ``length`` tokens from index ``start``."""

    item_id: bytes
    start: int
    length: int


def pad_id(item: bytes) -> int:
    """The u32 every placeholder token of ``item`` is rewritten to (DESIGN §4.1).

    ``PAD_ID_FLAG | (first 4 bytes of the item id, little-endian, with the top bit cleared)``.
    """
    if len(item) != HASH_BYTES:
        raise BlockIdentityError(f"item id must be {HASH_BYTES} bytes, got {len(item)}")
    return PAD_ID_FLAG | (int.from_bytes(item[:4], "little") & 0x7FFF_FFFF)


def apply_multimodal(
    tokens: Sequence[int], spans: Sequence[MultimodalSpan], page_size: int = DEFAULT_PAGE_SIZE
) -> tuple[list[int], dict[int, bytes]]:
    """Rewrite placeholder tokens to pad ids and build the per-page extra keys.

    Every page that the span ``[start, start + length)`` overlaps carries ``(item id, offset)``
    where ``offset`` is the position, within the item's span, of the first of the item's
    tokens that lies on that page: ``max(0, page_start - start)``. A page overlapped by
    several items lists them in the order of their ``start``. Returns the rewritten tokens
    and ``{page index: encode_extra_keys(...)}``, ready for ``block_hashes``.
    """
    if page_size <= 0:
        raise BlockIdentityError(f"page_size must be > 0, got {page_size}")
    out = list(tokens)
    per_page: dict[int, list[tuple[bytes, int]]] = {}
    end_prev = 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.length <= 0 or span.start < end_prev or span.start + span.length > len(out):
            raise BlockIdentityError(
                f"span start={span.start} length={span.length} must be non-empty, inside the "
                f"{len(out)} tokens, and not overlap the previous span (ends at {end_prev})"
            )
        end = span.start + span.length
        pad = pad_id(span.item_id)
        out[span.start : end] = [pad] * span.length
        for page in range(span.start // page_size, (end - 1) // page_size + 1):
            offset = max(0, page * page_size - span.start)
            per_page.setdefault(page, []).append((span.item_id, offset))
        end_prev = end
    return out, {page: encode_extra_keys(keys) for page, keys in per_page.items()}
