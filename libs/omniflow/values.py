"""Workflow values: plain Python values ↔ ``common.v1.Value``, and their types.

Inside the coordinator and the DSL a value is a plain Python object: ``str``, ``int``,
``float``, ``bool``, ``bytes``, ``list``, ``dict`` (a struct), :class:`Tokens`, or a
``TensorRef`` / ``MediaItem`` message kept as is (large data stays in the data plane;
only the reference travels).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from omniflow.api.common.v1 import common_pb2
from omniflow.errors import InvalidArgument


class VType(IntEnum):
    """Value types of workflow ports (mirrors ``coordinator.v1.ValueType``)."""

    ANY = 0
    TEXT = 1
    INT = 2
    FLOAT = 3
    BOOL = 4
    BYTES = 5
    TENSOR = 6
    LIST = 7
    STRUCT = 8
    TOKENS = 9
    MEDIA = 10


class Tokens(tuple[int, ...]):
    """A token id sequence (distinct from a list of ints so that it round-trips)."""

    __slots__ = ()


def to_python(value: common_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "text":
        return value.text
    if kind == "int_value":
        return value.int_value
    if kind == "float_value":
        return value.float_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "bytes_value":
        return value.bytes_value
    if kind == "list_value":
        return [to_python(v) for v in value.list_value.values]
    if kind == "struct_value":
        return {k: to_python(v) for k, v in value.struct_value.fields.items()}
    if kind == "token_ids":
        return Tokens(value.token_ids.ids)
    if kind == "tensor_ref":
        return value.tensor_ref
    return value.media


def from_python(obj: Any, where: str = "value") -> common_pb2.Value:
    """A Value message for ``obj``; raises InvalidArgument naming ``where`` otherwise."""
    if isinstance(obj, common_pb2.Value):
        return obj
    if isinstance(obj, bool):
        return common_pb2.Value(bool_value=obj)
    if isinstance(obj, int):
        return common_pb2.Value(int_value=obj)
    if isinstance(obj, float):
        return common_pb2.Value(float_value=obj)
    if isinstance(obj, str):
        return common_pb2.Value(text=obj)
    if isinstance(obj, bytes | bytearray):
        return common_pb2.Value(bytes_value=bytes(obj))
    if isinstance(obj, Tokens):
        return common_pb2.Value(token_ids=common_pb2.TokenIds(ids=list(obj)))
    if isinstance(obj, list | tuple):
        items = [from_python(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return common_pb2.Value(list_value=common_pb2.ListValue(values=items))
    if isinstance(obj, dict):
        fields = {str(k): from_python(v, f"{where}.{k}") for k, v in obj.items()}
        return common_pb2.Value(struct_value=common_pb2.StructValue(fields=fields))
    if isinstance(obj, common_pb2.TensorRef):
        return common_pb2.Value(tensor_ref=obj)
    if isinstance(obj, common_pb2.MediaItem):
        return common_pb2.Value(media=obj)
    raise InvalidArgument(
        f"{where}: {type(obj).__name__} is not a workflow value; accepted: str, int, float, "
        "bool, bytes, list, dict, Tokens, TensorRef, MediaItem"
    )


def type_of(obj: Any) -> VType:
    if isinstance(obj, bool):
        return VType.BOOL
    if isinstance(obj, int):
        return VType.INT
    if isinstance(obj, float):
        return VType.FLOAT
    if isinstance(obj, str):
        return VType.TEXT
    if isinstance(obj, bytes | bytearray):
        return VType.BYTES
    if isinstance(obj, Tokens):
        return VType.TOKENS
    if isinstance(obj, list | tuple):
        return VType.LIST
    if isinstance(obj, dict):
        return VType.STRUCT
    if isinstance(obj, common_pb2.TensorRef):
        return VType.TENSOR
    if isinstance(obj, common_pb2.MediaItem):
        return VType.MEDIA
    return VType.ANY


def compatible(produced: VType, expected: VType) -> bool:
    """Whether a value of type ``produced`` may feed a port of type ``expected``."""
    if VType.ANY in (produced, expected) or produced == expected:
        return True
    # An int is a fine float; a tensor may stand for bytes or media (by reference).
    return (produced, expected) in {
        (VType.INT, VType.FLOAT),
        (VType.TENSOR, VType.BYTES),
        (VType.TENSOR, VType.MEDIA),
    }


def check_type(obj: Any, expected: VType, where: str) -> None:
    got = type_of(obj)
    if not compatible(got, expected):
        raise InvalidArgument(f"{where} must be {expected.name.lower()}, got {got.name.lower()}")


def parse_cli_value(raw: str, expected: VType) -> Any:
    """A command-line ``k=v`` value as the port's type (text stays text)."""
    import json

    try:
        if expected == VType.INT:
            return int(raw)
        if expected == VType.FLOAT:
            return float(raw)
        if expected == VType.BOOL:
            low = raw.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return low in ("true", "1", "yes")
        if expected == VType.BYTES:
            return raw.encode()
        if expected in (VType.LIST, VType.STRUCT, VType.ANY) and raw[:1] in "[{":
            return json.loads(raw)
    except ValueError:
        raise InvalidArgument(f"{raw!r} is not a valid {expected.name.lower()}") from None
    return raw


def brief(obj: Any, limit: int = 80) -> str:
    """A one-line rendering of a value for progress output."""
    if isinstance(obj, bytes | bytearray):
        text = f"<{len(obj)} bytes>"
    elif isinstance(obj, common_pb2.TensorRef):
        text = f"<tensor {obj.dtype}{list(obj.shape)} at {obj.owner}>"
    else:
        text = repr(obj) if not isinstance(obj, str) else obj
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
