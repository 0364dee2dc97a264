"""Ownership events that KV owners (workers, node agents) publish to the KV index.

Shared by the agent's tiered store (which produces them) and the index core (which
applies them), so both sides agree on tiers and event kinds without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from omniflow.kv.blocks import HASH_BYTES


class Tier(IntEnum):
    """Where a page lives; a larger value is slower to reach."""

    DEVICE = 0
    HOST = 1
    SSD = 2


class EventKind(IntEnum):
    STORED = 0
    REMOVED = 1
    #: the owner dropped every block it held (namespace and hash are ignored)
    CLEARED = 2
    #: the owner dropped every block it held in ``tier`` (namespace and hash are ignored)
    CLEARED_TIER = 3


#: Kinds that name no block.
CLEAR_KINDS = frozenset((EventKind.CLEARED, EventKind.CLEARED_TIER))


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change of what an owner holds: ``namespace`` and ``block_hash`` are 16 bytes each."""

    kind: EventKind
    namespace: bytes = b""
    block_hash: bytes = b""
    tier: Tier = Tier.HOST

    def __post_init__(self) -> None:
        if self.kind not in CLEAR_KINDS and (
            len(self.namespace) != HASH_BYTES or len(self.block_hash) != HASH_BYTES
        ):
            raise ValueError(
                f"namespace and block_hash must be {HASH_BYTES} bytes, got "
                f"{len(self.namespace)} and {len(self.block_hash)}"
            )


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block an owner holds, as sent in a snapshot."""

    namespace: bytes
    block_hash: bytes
    tier: Tier
