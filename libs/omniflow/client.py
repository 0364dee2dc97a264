"""The Python client of the coordinator: register workflows, run them, follow runs.

::

    async with Client() as client:            # address: argument, env, or `omniflow up`
        await client.register(wf)
        result = await client.run("chain", {"question": "hello"})
        print(result.outputs["answer"])

Failed calls raise the domain errors of :mod:`omniflow.errors` (NotFound,
InvalidArgument, ResourceExhausted, ...).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.coordinator.v1 import coordinator_pb2_grpc
from omniflow.dsl.builder import Workflow
from omniflow.errors import Unavailable
from omniflow.rpc.client import open_channel
from omniflow.rpc.status import error_from_rpc
from omniflow.values import from_python, to_python

STREAM_TIMEOUT_S = 24 * 3600.0
STATE_NAMES = {v: k.removeprefix("RUN_STATE_").lower() for k, v in cpb.RunState.items()}


def coordinator_address(explicit: str = "") -> str:
    """The coordinator's address: the argument, ``OMNIFLOW_COORDINATOR_ADDR``, or the one
    ``omniflow up`` recorded in its run folder."""
    if explicit:
        return explicit
    env = os.environ.get("OMNIFLOW_COORDINATOR_ADDR", "")
    if env:
        return env
    folder = Path(os.environ.get("OMNIFLOW_RUN_DIR", ".omniflow/run"))
    state = folder / "state.json"
    if state.exists():
        for proc in json.loads(state.read_text()).get("procs", []):
            if proc.get("service") == "coordinator" and proc.get("address"):
                return str(proc["address"])
    raise Unavailable(
        "no coordinator address: pass --coordinator, set OMNIFLOW_COORDINATOR_ADDR, "
        "or start the local topology with `omniflow up`"
    )


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
    """A coordinator client over one channel."""

    def __init__(self, address: str = "", *, timeout_s: float = 30.0) -> None:
        self.address = coordinator_address(address)
        self._channel = open_channel(self.address, default_timeout_s=timeout_s)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: Any, **kw: Any) -> Any:
        try:
            return await getattr(self._stub, method)(request, **kw)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

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
        workflow: str, inputs: Mapping[str, Any], version: int, deadline_ms: int, run_id: str
    ) -> cpb.SubmitRunRequest:
        return cpb.SubmitRunRequest(
            workflow=workflow,
            version=version,
            inputs={k: from_python(v, f"input {k!r}") for k, v in inputs.items()},
            deadline_ms=deadline_ms,
            run_id=run_id,
        )

    async def submit(
        self,
        workflow: str,
        inputs: Mapping[str, Any],
        *,
        version: int = 0,
        deadline_ms: int = 0,
        run_id: str = "",
    ) -> str:
        """Start a run; returns its id at once."""
        req = self._request(workflow, inputs, version, deadline_ms, run_id)
        return str((await self._call("SubmitRun", req)).run_id)

    async def stream(
        self,
        workflow: str,
        inputs: Mapping[str, Any],
        *,
        version: int = 0,
        deadline_ms: int = 0,
        run_id: str = "",
    ) -> AsyncIterator[cpb.RunEvent]:
        """Start a run and yield its events until it finishes."""
        req = self._request(workflow, inputs, version, deadline_ms, run_id)
        # The stream lasts as long as the run: the run's own deadline (plus slack) bounds it.
        timeout = deadline_ms / 1000 + 10 if deadline_ms else STREAM_TIMEOUT_S
        call = self._stub.RunWorkflow(req, timeout=timeout)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def events(self, run_id: str, from_seq: int = 0) -> AsyncIterator[cpb.RunEvent]:
        """A run's events from ``from_seq`` (replayed), then live until it finishes."""
        call = self._stub.StreamRunEvents(
            cpb.StreamRunEventsRequest(run_id=run_id, from_seq=from_seq), timeout=STREAM_TIMEOUT_S
        )
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def run(
        self,
        workflow: str,
        inputs: Mapping[str, Any],
        *,
        version: int = 0,
        deadline_ms: int = 0,
        on_event: Callable[[cpb.RunEvent], None] | None = None,
    ) -> RunResult:
        """Run to the end; returns the result (a failed run is a result, not an error)."""
        events: list[cpb.RunEvent] = []
        async for event in self.stream(workflow, inputs, version=version, deadline_ms=deadline_ms):
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
