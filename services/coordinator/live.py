"""A run in progress on this coordinator: its record, its events in sequence, and the
listeners that follow them. The executor reports node progress into it (``RunSink``); the
run manager flushes what it holds to Redis. No gRPC, no Redis here."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.values import from_python


def now_ms() -> int:
    return int(time.time() * 1000)


class LiveRun:
    """A run in progress on this coordinator: record, events, and its task."""

    def __init__(self, run: cpb.Run) -> None:
        self.run = run
        self.key = run.run_id  # its name in the run store (``run_keys``): id and tenant
        self.events: list[cpb.RunEvent] = []
        self.flushed = 0
        self.flush_lock = asyncio.Lock()
        self.closed = False  # the final record is written: no more flushes
        self.changed = asyncio.Event()
        self.listeners = 0
        self._wake_pending = False
        self.task: asyncio.Task[None] | None = None
        self.registered: asyncio.Future[Any] | None = None  # the write of the active entry
        self.cancel_reason = ""
        self.nodes: dict[str, cpb.NodeState] = {}
        self.tenant = ""  # whose share of the runs in progress it takes ("" : none)

    def event(self, **event: Any) -> cpb.RunEvent:
        """The next event (not yet visible to listeners: see ``publish``)."""
        seq = len(self.events) + 1
        return cpb.RunEvent(run_id=self.run.run_id, seq=seq, unix_ms=now_ms(), **event)

    def publish(self, ev: cpb.RunEvent, at_once: bool = False) -> None:
        self.events.append(ev)
        if at_once:
            self.changed.set()  # the last event: nothing of the run left to go first
            return
        # Listeners wake behind what the loop already has queued (a 0 s timer: the next
        # node's worker call goes out before the event does); nobody listening: no work.
        if self.listeners and not self._wake_pending:
            self._wake_pending = True
            asyncio.get_running_loop().call_later(0, self._wake)

    def _wake(self) -> None:
        self._wake_pending = False
        self.changed.set()

    def emit(self, **event: Any) -> None:
        self.publish(self.event(**event))

    # -- RunSink
    def node_started(self, path: str, worker_id: str, attempt: int) -> None:
        state = self.nodes.get(path)
        if state is None:
            state = self.nodes[path] = cpb.NodeState(node=path, started_unix_ms=now_ms())
        state.state, state.worker_id, state.attempts = cpb.RUN_STATE_RUNNING, worker_id, attempt
        self.emit(node_started=cpb.NodeStarted(node=path, worker_id=worker_id, attempt=attempt))

    def node_output(self, path: str, output: str, chunk: Any) -> None:
        value = from_python(chunk, f"output {output!r} of node {path!r}")
        self.emit(node_output=cpb.NodeOutputChunk(node=path, output=output, chunk=value))

    def node_finished(self, path: str, state: int, error: str, duration_ms: float) -> None:
        ns = self.nodes.setdefault(path, cpb.NodeState(node=path, started_unix_ms=now_ms()))
        ns.state, ns.error, ns.finished_unix_ms = state, error, now_ms()  # type: ignore[assignment]
        self.emit(
            node_finished=cpb.NodeFinished(
                node=path,
                state=state,
                error=error,
                duration_ms=duration_ms,  # type: ignore[arg-type]
            )
        )

    def record(self) -> cpb.Run:
        run = cpb.Run()
        run.CopyFrom(self.run)
        del run.nodes[:]
        run.nodes.extend(self.nodes.values())
        return run
