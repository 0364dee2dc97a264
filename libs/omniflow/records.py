"""Build one record from another that has fields of the same names.

A protobuf message from its dataclass, a dataclass from a message, an options record from an
``argparse.Namespace``, a call from parsed flags: each copies field by field under the same
names. ``build(Target, source, **overrides)`` does it by the target's own field list, so
that list is written once, in the type; the overrides name only what differs (another name
on the source, a converted value, something the source does not have).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")

_PARAMETER_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def field_names(target: Callable[..., Any]) -> tuple[str, ...]:
    """The names ``target`` is built from: a dataclass's ``__init__`` fields, a protobuf
    message class's fields, or else a callable's parameters that can be passed by name."""
    if isinstance(target, type) and dataclasses.is_dataclass(target):
        return tuple(f.name for f in dataclasses.fields(target) if f.init)
    descriptor = getattr(target, "DESCRIPTOR", None)
    if descriptor is not None and hasattr(descriptor, "fields"):
        return tuple(f.name for f in descriptor.fields)
    params = inspect.signature(target).parameters.values()
    return tuple(p.name for p in params if p.kind in _PARAMETER_KINDS)


def build(target: Callable[..., R], source: object, /, **overrides: Any) -> R:
    """``target(**kwargs)`` where each of ``field_names(target)`` that ``source`` has as an
    attribute is copied from it, and ``overrides`` replace or add fields by name.

    A field the source lacks and no override gives keeps the target's default (a required
    one fails in the target, naming it); an override that is not a field fails here, so a
    misspelt name cannot be dropped silently.
    """
    names = field_names(target)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        name = getattr(target, "__qualname__", repr(target))
        raise TypeError(f"{name} has no field {', '.join(unknown)}; its fields: {names}")
    kwargs = {n: getattr(source, n) for n in names if n not in overrides and hasattr(source, n)}
    return target(**kwargs, **overrides)
