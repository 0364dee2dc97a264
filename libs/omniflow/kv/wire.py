"""Conversions between the KV protobuf messages and the plain KV types.

The proto ``Tier`` enum reserves 0 for "unspecified" (DEVICE=1, HOST=2, SSD=3) while
``omniflow.kv.events.Tier`` is DEVICE=0, HOST=1, SSD=2: every edge converts here.

A namespace is 16 bytes in the code and on the wire (``namespace_id``, or ``kv_namespace_id``
where the field says which namespace). The older hex ``string`` field of the same messages
is still written for one release (``namespace_fields``) and read only when the bytes field is
empty (``read_namespace``), so a client built before the bytes fields keeps working.
"""

from __future__ import annotations

from typing import Any

from omniflow.api.common.v1 import common_pb2
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import HASH_BYTES, BlockIdentityError, KVLayout
from omniflow.kv.blocks import check_hashes as check_hashes  # the servers' import
from omniflow.kv.events import Tier
from omniflow.records import build


def tier_to_proto(tier: Tier) -> int:
    return int(tier) + 1


def tier_from_proto(value: int, what: str = "tier") -> Tier:
    """The core tier of a proto ``Tier``; unspecified or unknown values are InvalidArgument."""
    if value not in (1, 2, 3):
        raise InvalidArgument(f"{what} must be TIER_DEVICE, TIER_HOST or TIER_SSD, got {value}")
    return Tier(value - 1)


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return build(common_pb2.KVLayout, layout)


def layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    """A KVLayout; missing or bad fields are InvalidArgument naming the field."""
    try:
        return build(KVLayout, msg, dtype=msg.dtype or "float32")
    except BlockIdentityError as exc:
        raise InvalidArgument(f"layout: {exc}") from None


def parse_namespace(text: str) -> bytes:
    """The 16 bytes of a namespace given as 32 hex digits."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != HASH_BYTES:
        raise InvalidArgument(
            f"namespace must be {2 * HASH_BYTES} hex digits ({HASH_BYTES} bytes), got {text!r}"
        )
    return raw


def namespace_fields(namespace: bytes, field: str = "namespace") -> dict[str, Any]:
    """The keyword arguments that put ``namespace`` in a message: the bytes field
    ``<field>_id`` and, for one release, the deprecated hex ``<field>``. Empty stays empty."""
    return {f"{field}_id": namespace, field: namespace.hex()}


def set_namespace(msg: Any, namespace: bytes, field: str = "namespace") -> None:
    """Set both namespace fields of ``msg`` (see ``namespace_fields``)."""
    for name, value in namespace_fields(namespace, field).items():
        setattr(msg, name, value)


def read_namespace(msg: Any, field: str = "namespace", *, optional: bool = False) -> bytes:
    """The 16-byte namespace a message carries: ``<field>_id`` first, the deprecated hex
    ``<field>`` when that is empty (an old client). InvalidArgument for a malformed one, or
    for none at all unless ``optional`` (then ``b""``)."""
    raw = getattr(msg, f"{field}_id")
    if raw:
        if len(raw) != HASH_BYTES:
            raise InvalidArgument(
                f"{field}_id must be {HASH_BYTES} bytes (a namespace id), got {len(raw)}"
            )
        return bytes(raw)
    text = getattr(msg, field)
    if not text and optional:
        return b""
    return parse_namespace(text)
