"""What the run engine exchanges with the outside: a call as it reaches a
:class:`WorkerCaller`, the worker picked for it, the progress sink of a run, and picks
made before a node needs them. No gRPC here."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.errors import OmniflowError
from omniflow.values import to_python

ChunkSink = Callable[[str, Any], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class CallRequest:
    """One call of an operation, as the engine hands it to a WorkerCaller."""

    request_id: str
    role: str
    operation: str
    inputs: dict[str, Any]
    params: dict[str, Any]
    strategy: int = 0  # router.v1.Strategy value; 0: the role's default
    session_key: str = ""
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """A worker picked for a call."""

    worker_id: str
    address: str
    kv_namespace: bytes = b""  # the prompt's ids are sent when they are of this namespace
    node: str = ""  # its node (whose kv-agent it writes its pages through to)


class WorkerCaller(Protocol):
    """How the engine reaches workers. Errors are domain errors (their ``code_name``
    decides retries)."""

    async def pick(self, req: CallRequest, exclude: tuple[str, ...]) -> Target: ...

    async def invoke(
        self, target: Target, req: CallRequest, on_chunk: ChunkSink | None
    ) -> dict[str, Any]: ...

    async def report(self, target: Target, ok: bool, latency_ms: float, code: str) -> None: ...

    def pick_reads(self, role: str, operation: str, strategy: int) -> tuple[str, ...]:
        """Inputs whose values ``pick`` reads for such a call (e.g. the prompt, for KV
        hints): the engine picks ahead only when they are known before the call."""
        ...


class RunSink(Protocol):
    """Receives the run's progress (the run manager turns it into RunEvents)."""

    def node_started(self, path: str, worker_id: str, attempt: int) -> None: ...

    def node_output(self, path: str, output: str, chunk: Any) -> None: ...

    def node_finished(self, path: str, state: int, error: str, duration_ms: float) -> None: ...


# A worker picked ahead is used only if the pick is this recent (load changes).
PICK_AHEAD_MAX_AGE_S = 0.1
# The outcome of a pick that was never used: neutral for the router's breaker (the worker
# did nothing, so it neither succeeded nor failed), but it ends the outstanding call.
UNUSED_PICK_CODE = "CANCELLED"


@dataclass(slots=True)
class PickAhead:
    """A pick made before its node needed it (``at``: loop time it was asked)."""

    task: asyncio.Future[Target]
    at: float


def pick_entries(
    caller: WorkerCaller, nodes: list[cpb.Node], inputs: Mapping[str, Any]
) -> dict[str, PickAhead]:
    """Start the picks of the call nodes that read only graph inputs and constants, before
    the run itself starts (the coordinator overlaps them with its Redis read). The
    caller releases them (``release_picks``) if the run does not start."""
    loop = asyncio.get_running_loop()
    out: dict[str, PickAhead] = {}
    for node in nodes:
        if node.WhichOneof("kind") != "call" or node.max_concurrency:
            continue  # a limited node picks once it holds its slot
        if any(s.streaming or s.HasField("node_output") for s in node.inputs.values()):
            continue
        spec = node.call
        session = ""
        if spec.session_key_input in node.inputs:
            session = str(_static(node.inputs[spec.session_key_input], inputs) or "")
        reads = caller.pick_reads(spec.role, spec.operation, spec.strategy)
        req = CallRequest(
            "",
            spec.role,
            spec.operation,
            {name: _static(node.inputs[name], inputs) for name in reads if name in node.inputs},
            {},
            spec.strategy,
            session,
            node.timeout_ms / 1000 if node.timeout_ms else None,
        )
        out[node.name] = PickAhead(asyncio.ensure_future(caller.pick(req, ())), loop.time())
    return out


def _static(src: cpb.Source, inputs: Mapping[str, Any]) -> Any:
    """The value of a source that is a graph input or a constant."""
    if src.HasField("graph_input"):
        return inputs.get(src.graph_input)
    return to_python(src.constant)


async def release_picks(caller: WorkerCaller, picks: Mapping[str, PickAhead]) -> None:
    """Give back picks that will not be used (the router counts them as outstanding)."""
    for ahead in picks.values():
        try:
            target = await ahead.task
        except (OmniflowError, asyncio.CancelledError):
            continue
        await caller.report(target, False, 0.0, UNUSED_PICK_CODE)
