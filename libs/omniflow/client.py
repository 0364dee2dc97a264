"""The Python client of the coordinator: register workflows, run them, follow runs.

::

    async with Client() as client:            # address: argument, env, or `omniflow up`
        await client.register(wf)
        result = await client.run("chain", {"question": "hello"})
        print(result.outputs["answer"])

Failed calls raise the domain errors of :mod:`omniflow.errors` (NotFound,
InvalidArgument, ResourceExhausted, ...).

Failover: the client knows every coordinator it can find — the addresses given
(comma-separated), ``OMNIFLOW_COORDINATOR_ADDR``, or those of the local topology's
``state.json`` and of its discovery — and a call that finds its coordinator UNAVAILABLE
moves to the next one, with doubling backoff, for up to ``failover_s``. Runs carry a
client-made id, so a submission retried elsewhere is the same run; a run's event stream
that breaks resumes on another coordinator from the last event seen, and waits (up to
``resume_s``) for a run whose coordinator died to be adopted and ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.coordinator.v1 import coordinator_pb2_grpc
from omniflow.backoff import Backoff
from omniflow.config import local_settings
from omniflow.dsl.builder import Workflow
from omniflow.errors import Unavailable
from omniflow.rpc.client import open_channel
from omniflow.values import from_python, to_python

log = logging.getLogger(__name__)

STREAM_TIMEOUT_S = 24 * 3600.0
STATE_NAMES = {v: k.removeprefix("RUN_STATE_").lower() for k, v in cpb.RunState.items()}
FAILOVER_S = 15.0  # how long a call keeps trying coordinators
RESUME_S = 60.0  # how long a broken run stream waits for its run to end elsewhere
_BACKOFF_S, _MAX_BACKOFF_S = 0.1, 2.0


def _split(addresses: str) -> list[str]:
    return [a.strip() for a in addresses.split(",") if a.strip()]


def _run_folder() -> Path:
    return Path(local_settings().run_dir)


def _local_state() -> dict[str, Any]:
    state = _run_folder() / "state.json"
    try:
        return dict(json.loads(state.read_text()))
    except (OSError, ValueError):
        return {}


def coordinator_addresses(explicit: str = "") -> list[str]:
    """Every coordinator address known without a network call: the argument or
    ``OMNIFLOW_COORDINATOR_ADDR`` (comma-separated), else those ``omniflow up``
    recorded in its run folder."""
    given = _split(explicit) or _split(local_settings().coordinator_addr)
    if given:
        return given
    found = [
        str(p["address"])
        for p in _local_state().get("procs", [])
        if p.get("service") == "coordinator" and p.get("address")
    ]
    if found:
        return found
    raise Unavailable(
        "no coordinator address: pass --coordinator, set OMNIFLOW_COORDINATOR_ADDR, "
        "or start the local topology with `omniflow up`"
    )


async def _discovered() -> list[str]:
    """Coordinators registered in the local topology's discovery (Redis), if any."""
    url = str(_local_state().get("env", {}).get("OMNIFLOW_REDIS_URL", ""))
    if not url:
        return []
    from omniflow.discovery import make_registry  # only when failing over

    registry = make_registry("redis", url=url, timeout_s=1.0)
    try:
        return [i.address for i in await registry.list("coordinator")]
    except Exception:  # discovery itself may be what is down
        return []
    finally:
        with contextlib.suppress(Exception):
            await registry.close()


class RunOptions(TypedDict, total=False):
    """How ``submit``, ``stream`` and ``run`` start a run; each is left out by default."""

    version: int  # the workflow version; 0 (default): the latest
    deadline_ms: int  # 0 (default): the workflow's own
    run_id: str  # a client-chosen id; "" (default): one is made for the submission


@dataclass(slots=True)
class RunResult:
    """How a run ended, with its outputs as plain Python values."""

    run_id: str
    state: str
    outputs: dict[str, Any]
    error: str = ""
    events: list[cpb.RunEvent] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"


class Client:
    """A coordinator client that fails over between coordinators (module docstring)."""

    def __init__(
        self,
        address: str = "",
        *,
        timeout_s: float = 30.0,
        failover_s: float = FAILOVER_S,
        resume_s: float = RESUME_S,
        run_dir: Path | None = None,
    ) -> None:
        self._explicit = address
        self._addresses = coordinator_addresses(address)
        local = not _split(address) and not _split(local_settings().coordinator_addr)
        if run_dir is not None or local:
            # A local topology (``omniflow up``; ``run_dir`` names its run folder when the
            # addresses are given): present that run folder's client certificate and token.
            from omniflow.security.local import use_local_security

            use_local_security(run_dir if run_dir is not None else _run_folder())
        self.address = self._addresses[0]
        self.timeout_s, self.failover_s, self.resume_s = timeout_s, failover_s, resume_s
        self._channels: dict[str, tuple[Any, coordinator_pb2_grpc.CoordinatorServiceStub]] = {}
        self.failovers = 0

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()

    @property
    def _stub(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        entry = self._channels.get(self.address)
        if entry is None:
            channel = open_channel(self.address, default_timeout_s=self.timeout_s)
            entry = (channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel))
            self._channels[self.address] = entry
        return entry[1]

    async def _fail_over(self) -> None:
        """Move to the next coordinator, re-reading where they are (a restarted one
        may have moved; the local topology's discovery may know more)."""
        self.failovers += 1
        known = list(self._addresses)
        with contextlib.suppress(Unavailable):
            known += [a for a in coordinator_addresses(self._explicit) if a not in known]
        if not self._explicit:
            known += [a for a in await _discovered() if a not in known]
        self._addresses = known
        i = known.index(self.address) if self.address in known else -1
        nxt = known[(i + 1) % len(known)]
        log.info("coordinator %s unavailable; trying %s", self.address, nxt)
        self.address = nxt

    async def _retrying(self, attempt: Any, budget_s: float | None = None) -> Any:
        """``await attempt()`` until it succeeds, fails with anything but UNAVAILABLE,
        or ``budget_s`` (default ``failover_s``) is spent; fails over in between."""
        budget = self.failover_s if budget_s is None else budget_s
        backoff = Backoff.within(budget, _BACKOFF_S, _MAX_BACKOFF_S)
        while True:
            try:
                return await attempt()
            except Unavailable:
                delay = backoff.next()
                if delay is None:
                    raise
            await self._fail_over()
            await asyncio.sleep(delay)

    async def _call(self, method: str, request: Any, **kw: Any) -> Any:
        return await self._retrying(lambda: getattr(self._stub, method)(request, **kw))

    # -- workflows
    async def register(self, workflow: Workflow | cpb.WorkflowGraph) -> int:
        """Register (compiling a DSL workflow first); returns the new version."""
        graph = workflow.compile() if isinstance(workflow, Workflow) else workflow
        reply = await self._call("RegisterWorkflow", cpb.RegisterWorkflowRequest(graph=graph))
        return int(reply.version)

    async def get_workflow(self, name: str, version: int = 0) -> cpb.WorkflowGraph:
        reply = await self._call("GetWorkflow", cpb.GetWorkflowRequest(name=name, version=version))
        return reply.graph

    async def list_workflows(self) -> list[cpb.WorkflowSummary]:
        reply = await self._call("ListWorkflows", cpb.ListWorkflowsRequest())
        return list(reply.workflows)

    # -- runs
    @staticmethod
    def _request(
        workflow: str, inputs: Mapping[str, Any], options: RunOptions
    ) -> cpb.SubmitRunRequest:
        # The options are the request's fields of the same names (a misspelt one fails here).
        req = cpb.SubmitRunRequest(
            workflow=workflow,
            inputs={k: from_python(v, f"input {k!r}") for k, v in inputs.items()},
            **options,
        )
        # Made here: a submission retried on another coordinator is the same run.
        req.run_id = req.run_id or uuid.uuid4().hex
        return req

    async def submit(
        self, workflow: str, inputs: Mapping[str, Any], **options: Unpack[RunOptions]
    ) -> str:
        """Start a run; returns its id at once."""
        req = self._request(workflow, inputs, options)
        return str((await self._call("SubmitRun", req)).run_id)

    async def stream(
        self, workflow: str, inputs: Mapping[str, Any], **options: Unpack[RunOptions]
    ) -> AsyncIterator[cpb.RunEvent]:
        """Start a run and yield its events until it finishes (across coordinators)."""
        req = self._request(workflow, inputs, options)
        # The stream lasts as long as the run: the run's own deadline (plus slack) bounds it.
        timeout = req.deadline_ms / 1000 + 10 if req.deadline_ms else STREAM_TIMEOUT_S
        seen = 0
        try:
            async for event in self._stub.RunWorkflow(req, timeout=timeout):
                seen = event.seq
                yield event
                if event.HasField("run_finished"):
                    return
        except Unavailable as exc:
            log.info("run %s: stream broke (%s); resuming elsewhere", req.run_id, exc)
        # Accepted or not, the id is ours: submit again (idempotent), then follow it.
        if seen == 0:
            await self._call("SubmitRun", req)
        async for event in self.events(req.run_id, seen + 1):
            yield event

    async def events(self, run_id: str, from_seq: int = 0) -> AsyncIterator[cpb.RunEvent]:
        """A run's events from ``from_seq`` (replayed), then live until it finishes.

        A stream that breaks (or ends before RunFinished: the run's coordinator died and
        the run is not adopted yet) resumes on a coordinator from the last event seen,
        for up to ``resume_s``."""
        next_seq = from_seq
        backoff = Backoff.within(self.resume_s, _BACKOFF_S, _MAX_BACKOFF_S)
        while True:
            req = cpb.StreamRunEventsRequest(run_id=run_id, from_seq=next_seq)
            try:
                async for event in self._stub.StreamRunEvents(req, timeout=STREAM_TIMEOUT_S):
                    next_seq = event.seq + 1
                    yield event
                    if event.HasField("run_finished"):
                        return
                error: Exception = Unavailable(f"run {run_id} has not finished yet")
            except Unavailable as exc:
                error = exc
                await self._fail_over()
            delay = backoff.next()
            if delay is None:
                raise Unavailable(
                    f"run {run_id}: no coordinator reported its end within {self.resume_s:.0f}"
                    f" s ({error})"
                )
            await asyncio.sleep(delay)

    async def run(
        self,
        workflow: str,
        inputs: Mapping[str, Any],
        *,
        on_event: Callable[[cpb.RunEvent], None] | None = None,
        **options: Unpack[RunOptions],
    ) -> RunResult:
        """Run to the end; returns the result (a failed run is a result, not an error)."""
        events: list[cpb.RunEvent] = []
        async for event in self.stream(workflow, inputs, **options):
            events.append(event)
            if on_event is not None:
                on_event(event)
            if event.HasField("run_finished"):
                fin = event.run_finished
                return RunResult(
                    event.run_id,
                    STATE_NAMES[fin.state],
                    {k: to_python(v) for k, v in fin.outputs.items()},
                    fin.error,
                    events,
                )
        raise Unavailable("the coordinator ended the run's stream before the run finished")

    async def get_run(self, run_id: str) -> cpb.Run:
        return (await self._call("GetRun", cpb.GetRunRequest(run_id=run_id))).run

    async def cancel(self, run_id: str, reason: str = "") -> str:
        reply = await self._call("CancelRun", cpb.CancelRunRequest(run_id=run_id, reason=reason))
        return STATE_NAMES[reply.state]
