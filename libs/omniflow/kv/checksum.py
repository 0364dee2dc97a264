"""Page checksums: xxh3_64 of the page bytes, carried with every page that leaves memory
(SSD, network) and verified before the page is served."""

from __future__ import annotations

import xxhash

from omniflow.errors import DataLoss


def page_checksum(buf: bytes | bytearray | memoryview) -> int:
    """xxh3_64 of a bytes-like object (numpy arrays and memoryviews are hashed in place)."""
    return xxhash.xxh3_64_intdigest(buf)


def verify_checksum(buf: bytes | bytearray | memoryview, expected: int, what: str = "page") -> None:
    """Raise ``DataLoss`` when ``buf`` does not hash to ``expected``."""
    got = xxhash.xxh3_64_intdigest(buf)
    if got != expected:
        raise DataLoss(f"{what}: checksum mismatch (expected {expected:016x}, got {got:016x})")
