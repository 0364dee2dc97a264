"""Helpers for tests that run services in this process (``ServiceHost``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from omniflow.config import load_settings

S = TypeVar("S")


def host_settings(cls: type[S], redis_url: str, **extra: Any) -> S:
    """``cls``'s defaults (no environment) for a host on ``redis_url``: port 0, no metrics
    port, a registration TTL of 2 s; ``extra`` overrides."""
    base = load_settings(cls, env={})
    return dataclasses.replace(  # type: ignore[type-var]
        base, redis_url=redis_url, port=0, metrics_port=-1, registration_ttl_s=2.0, **extra
    )


async def eventually(
    predicate: Callable[[], Awaitable[object]], timeout_s: float, what: str
) -> float:
    """Seconds until ``await predicate()`` holds (checked every 50 ms); fails naming
    ``what`` after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await predicate():
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {what}")
