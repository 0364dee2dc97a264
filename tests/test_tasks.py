"""Stopping a background task (``omniflow.tasks.stop_task``): cancelled and waited for."""

from __future__ import annotations

import asyncio

import pytest

from omniflow.tasks import stop_task


async def test_a_running_loop_is_cancelled_and_has_unwound_when_stop_returns() -> None:
    unwound: list[str] = []

    async def loop() -> None:
        try:
            await asyncio.Event().wait()  # never set: runs until cancelled
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits still runs to the end
            unwound.append("finally")

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.02)
    await stop_task(task)
    assert task.cancelled() and unwound == ["finally"]


async def test_none_and_a_finished_task_are_nothing_to_stop() -> None:
    await stop_task(None)

    async def done() -> int:
        return 3

    task = asyncio.create_task(done())
    await task
    await stop_task(task)
    assert task.result() == 3


async def test_a_task_that_failed_raises_its_error() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)  # it has run and failed before it is stopped
    with pytest.raises(ValueError, match="boom"):
        await stop_task(task)
