"""The ``PageChunk`` stream format of the kv-agent API, for both of its ends.

``GetPages`` and ``PutPages`` move pages as chunks: each page is cut in pieces of at most
``chunk_bytes``, in order, the namespace and the page's xxh3_64 checksum on its first
chunk, ``last`` on its final one. ``page_chunks`` writes such a stream; ``ChunkOrder``
checks one as it arrives (the agent's receiver and the worker's ``PageAssembler`` both read
through it, so the two sides agree on what a well-formed stream is).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from omniflow.api.kvagent.v1 import kvagent_pb2
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import check_hash
from omniflow.kv.checksum import page_checksum
from omniflow.kv.wire import namespace_fields

PageData = bytes | bytearray | memoryview | np.ndarray


def as_bytes(page: PageData) -> memoryview:
    """A flat byte view of ``page`` (no copy for contiguous arrays)."""
    if isinstance(page, np.ndarray):
        return memoryview(np.ascontiguousarray(page).reshape(-1).view(np.uint8))
    return memoryview(page).cast("B")


def page_chunks(
    namespace: bytes, hashes: Sequence[bytes], pages: Sequence[PageData], chunk_bytes: int
) -> Iterator[kvagent_pb2.PageChunk]:
    """The chunk stream of ``pages``: each page cut in chunks of ``chunk_bytes``, its
    checksum and the namespace (bytes, and its deprecated hex) on its first chunk."""
    if chunk_bytes <= 0:
        raise InvalidArgument(f"chunk_bytes must be > 0, got {chunk_bytes}")
    first = namespace_fields(namespace)
    for h, page in zip(hashes, pages, strict=True):
        buf = as_bytes(page)
        size = len(buf)
        for off in range(0, max(size, 1), chunk_bytes):
            end = min(off + chunk_bytes, size)
            yield kvagent_pb2.PageChunk(
                **(first if off == 0 else {}),
                block_hash=h,
                offset=off,
                data=bytes(buf[off:end]),
                page_bytes=size,
                checksum=page_checksum(buf) if off == 0 else 0,
                last=end == size,
            )


class ChunkOrder:
    """Checks a chunk stream of ``page_bytes``-byte pages as it arrives.

    ``feed`` raises InvalidArgument on a malformed chunk (a bad hash, a page of another size,
    a first chunk not at 0, chunks out of order or past the page, a page marked last before
    it is whole, a chunk over ``max_chunk_bytes``); with ``expected``, the pages must be
    exactly those hashes in that order. Between calls, ``block_hash``, ``checksum`` (the
    sender's) and ``offset`` describe the open page ("" hash: none open).
    """

    def __init__(
        self, page_bytes: int, expected: Sequence[bytes] | None = None, max_chunk_bytes: int = 0
    ) -> None:
        self.page_bytes = page_bytes
        self.expected = list(expected) if expected is not None else None
        self.max_chunk_bytes = max_chunk_bytes
        self.pages = 0  # pages opened so far
        self.block_hash = b""
        self.checksum = 0
        self.offset = 0

    def feed(self, chunk: kvagent_pb2.PageChunk) -> bool:
        """Check ``chunk``; True when it opens a page. ``offset`` is where it starts."""
        pb = self.page_bytes
        n = len(chunk.data)
        if self.max_chunk_bytes and n > self.max_chunk_bytes:
            raise InvalidArgument(
                f"chunk of {n} bytes exceeds the limit of {self.max_chunk_bytes} bytes"
            )
        opens = not self.block_hash
        if opens:
            check_hash(chunk.block_hash, "block hash")
            if chunk.page_bytes != pb:
                raise InvalidArgument(
                    f"page {chunk.block_hash.hex()} is {chunk.page_bytes} bytes; the "
                    f"namespace has pages of {pb} bytes"
                )
            if chunk.offset != 0:
                raise InvalidArgument(
                    f"page {chunk.block_hash.hex()} starts at offset {chunk.offset}; its first "
                    "chunk must be at 0"
                )
            if self.expected is not None and (
                self.pages >= len(self.expected) or chunk.block_hash != self.expected[self.pages]
            ):
                raise InvalidArgument(
                    f"page {chunk.block_hash.hex()} was not asked for at position "
                    f"{self.pages} of the stream"
                )
            self.pages += 1
            self.block_hash, self.offset, self.checksum = chunk.block_hash, 0, chunk.checksum
        elif chunk.block_hash != self.block_hash or chunk.offset != self.offset:
            raise InvalidArgument(
                f"page {self.block_hash.hex()} ended after {self.offset} of {pb} bytes (next "
                f"chunk: page {chunk.block_hash.hex()} offset {chunk.offset}); chunks must be "
                "in order"
            )
        if self.offset + n > pb:
            raise InvalidArgument(
                f"page {self.block_hash.hex()}: chunk at {self.offset} of {n} bytes runs past "
                f"{pb} bytes"
            )
        if chunk.last and self.offset + n != pb:
            raise InvalidArgument(
                f"page {self.block_hash.hex()} marked last after {self.offset + n} of {pb} bytes"
            )
        return opens

    def advance(self, chunk: kvagent_pb2.PageChunk) -> None:
        """Move past ``chunk`` (after ``feed`` accepted it and its bytes were taken)."""
        self.offset += len(chunk.data)
        if chunk.last:
            self.block_hash = b""


class PageAssembler:
    """Rebuilds pages from a ``GetPages`` stream; keeps the leading run of whole, verified
    pages in the order asked for (the first fault ends the run, it is not raised)."""

    def __init__(self, hashes: Sequence[bytes], page_bytes: int) -> None:
        self.hashes = list(hashes)
        self.page_bytes = page_bytes
        self.pages: list[bytearray] = []
        self.checksum_failures = 0
        self._order = ChunkOrder(page_bytes, self.hashes)
        self._buf = bytearray()
        self._done = False

    def feed(self, chunk: kvagent_pb2.PageChunk) -> None:
        if self._done:
            return
        try:
            if self._order.feed(chunk):
                self._buf = bytearray()
        except InvalidArgument:
            self._done = True  # out of order, unasked or malformed: stop at the run we have
            return
        self._buf += chunk.data
        want = self._order.checksum
        self._order.advance(chunk)
        if chunk.last:
            if page_checksum(self._buf) != want:
                self.checksum_failures += 1
                self._done = True
                return
            self.pages.append(self._buf)
            self._buf = bytearray()
