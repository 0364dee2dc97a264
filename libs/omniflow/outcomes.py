"""A caller's outcomes of its router picks, batched into ``ReportOutcomes`` off the call path.

The gateway and the coordinator tell the router how every call to a picked worker went; the
router's breakers and load read them. A call never waits for its report: outcomes gather for
``REPORT_INTERVAL_S`` and go as one ``ReportOutcomes`` call, an urgent one (a failure) at
once so that a breaker reacts quickly. Reports are advice: a batch that fails is logged and
dropped, never retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from omniflow.api.router.v1 import router_pb2
from omniflow.errors import OmniflowError

log = logging.getLogger(__name__)

#: How long outcomes gather before they go as one ReportOutcomes call.
REPORT_INTERVAL_S = 0.02


class OutcomeReports:
    """Outcomes to the router that ``router()`` answers, each batch within ``timeout_s``."""

    def __init__(
        self,
        router: Callable[[], Awaitable[Any]],
        timeout_s: float,
        interval_s: float = REPORT_INTERVAL_S,
    ) -> None:
        self._router, self.timeout_s, self.interval_s = router, timeout_s, interval_s
        self._pending: list[router_pb2.ReportOutcomeRequest] = []
        self._sender: asyncio.Task[None] | None = None

    def add(
        self, worker_id: str, ok: bool, latency_ms: float, code: str = "", *, urgent: bool
    ) -> None:
        """Queue one outcome; a sender starts when none runs (at once when ``urgent``)."""
        self._pending.append(
            router_pb2.ReportOutcomeRequest(
                worker_id=worker_id, success=ok, latency_ms=latency_ms, error_code=code
            )
        )
        if self._sender is None or self._sender.done():
            delay = 0.0 if urgent else self.interval_s
            self._sender = asyncio.get_running_loop().create_task(self._send(delay))

    async def _send(self, delay: float) -> None:
        await asyncio.sleep(delay)
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                stub = await self._router()
                await stub.ReportOutcomes(
                    router_pb2.ReportOutcomesRequest(outcomes=batch), timeout=self.timeout_s
                )
            except OmniflowError as exc:
                log.debug("ReportOutcomes (%d) failed: %s", len(batch), exc)

    async def close(self, wait_s: float = 0.0) -> None:
        """Let the pending outcomes go for up to ``wait_s``, then stop the sender."""
        sender = self._sender
        if sender is None or sender.done():
            return
        if wait_s > 0:
            await asyncio.wait([sender], timeout=wait_s)
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
