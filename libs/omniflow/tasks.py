"""Background asyncio tasks: the one way a component stops the loop it started.

    await stop_task(self._task)  # cancelled, and waited for until it has unwound

The task's own ``CancelledError`` is swallowed (that is how it ends); any other exception
it ended with propagates, as awaiting it would.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait until it has finished."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
