"""A blocking generator as an async stream: it runs in a worker thread, each item is
handed to the event loop as soon as it is produced, and closing the stream stops it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of ``make()`` in order; an exception it raises is raised here. Closing this
    stream early (client gone) stops the thread after its current item."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[T | BaseException | None] = asyncio.Queue()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in make():
                if stop.is_set():
                    break
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except BaseException as exc:  # handed to the stream
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    task = asyncio.create_task(asyncio.to_thread(work))
    try:
        while True:
            item = await queue.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        await asyncio.shield(task)
