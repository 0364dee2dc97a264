"""The gateway's gRPC side: discovery, the pick of a worker, worker and coordinator calls.
Everything here returns plain data and raises domain errors, so the core never sees
protobuf or gRPC types.

The pick runs in this process (``omniflow.routing.picker.Picker``, the policy the router's
Pick serves the coordinator): a worker table fed by the discovery listings the catalog
reads, the calls this gateway has in flight on each worker, their outcomes (breakers),
each worker's reported queue (``GetLoad`` every ``OMNIFLOW_ROUTER_HEALTH_INTERVAL_S``) and,
for kv_aware, the one prefix match against the KV index. A pick that finds no live worker
of the model (one worker restarting) is made again, on a fresh listing, within
``failover_wait_s``.

Cancelling (or closing) a stream returned here cancels its RPC: a client that
disconnects ends the worker's request (the worker aborts it and frees its pages).

Coordinators are called through ``replicas.Replicas``: every replica in discovery, failing
over on UNAVAILABLE and waiting (``failover_wait_s``) while none answers. A workflow run
carries a run id made here, so that a run whose coordinator died is followed on another
one (which adopts it), not submitted twice.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Unpack

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.backoff import Backoff
from omniflow.discovery import Registry, find_address
from omniflow.dsl.flow import chat_parts, output_flow
from omniflow.errors import NotFound, OmniflowError, Unavailable
from omniflow.finish import finish_from_proto
from omniflow.routing.picker import Picker, PickOptions
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.tasks import stop_task
from omniflow.values import from_python, to_python
from omniflow.wav import wav_bytes
from omniflow.workers import WORKER_SERVICE, WorkerRecord, worker_from_instance
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.gateway.replicas import BACKOFF_S, MAX_BACKOFF_S, Replicas
from omniflow_services.gateway.types import (
    GenChunk,
    GenerateCall,
    NodeInfo,
    Picked,
    RunChunk,
    WorkflowInfo,
)

log = logging.getLogger(__name__)

RUN_STREAM_SLACK_S = 10.0  # a run's stream outlives its deadline by this much


def _request_proto(call: GenerateCall) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(request_id=call.request_id, sampling=call.sampling.to_proto())
    if call.token_ids is not None:
        req.token_ids.ids.extend(call.token_ids)
        return req
    msgs = []
    for role, parts in call.messages or []:
        content = []
        for p in parts:
            if isinstance(p, str):
                content.append(worker_pb2.ContentPart(text=p))
            else:
                item = common_pb2.MediaItem(
                    kind=common_pb2.MediaItem.KIND_IMAGE, data=p.data, mime_type=p.mime_type
                )
                content.append(worker_pb2.ContentPart(media=item))
        msgs.append(worker_pb2.ChatMessage(role=role, content=content))
    req.messages.CopyFrom(worker_pb2.ChatMessages(messages=msgs, add_generation_prompt=True))
    return req


class Backends:
    """Discovery listings, the pick, the coordinator and worker channels of a gateway."""

    def __init__(self, settings: GatewaySettings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self._channels: dict[str, TracedChannel] = {}
        self._workers: dict[str, worker_pb2_grpc.WorkerServiceStub] = {}
        wait_s = settings.failover_wait_s
        # One candidate: no index match (the same worker; the router's Pick still asks).
        self.picker = Picker(settings, match_alone=False)
        self.picker.open_index(self._index_address)
        self._health: asyncio.Task[None] | None = None
        self.coordinators: Replicas[coordinator_pb2_grpc.CoordinatorServiceStub] = Replicas(
            registry,
            "coordinator",
            settings.coordinator_addr,
            self._channel,
            coordinator_pb2_grpc.CoordinatorServiceStub,
            wait_s,
        )
        self._listing: tuple[float, list[WorkerRecord]] | None = None

    def start(self) -> None:
        """Poll the workers' load and health (``OMNIFLOW_ROUTER_HEALTH_INTERVAL_S``; 0: never)
        for the pick, until ``close``."""
        if self.settings.health_interval_s > 0 and self._health is None:
            self._health = asyncio.create_task(self.picker.poll_health(self._queue_of))

    # ------------------------------------------------------------ discovery

    async def workers(self) -> list[WorkerRecord]:
        """Live workers, from a listing at most ``catalog_ttl_s`` old; while discovery does not
        answer (its Redis restarting), the last listing it gave, as the replicas do."""
        now = time.monotonic()
        if self._listing is not None and now - self._listing[0] < self.settings.catalog_ttl_s:
            return self._listing[1]
        try:
            found = [worker_from_instance(i) for i in await self.registry.list(WORKER_SERVICE)]
        except Unavailable as exc:
            if self._listing is None:
                raise
            log.warning("worker listing failed (%s); using the last one", exc)
            return self._listing[1]
        if self._listing is None or self._listing[1] != found:
            self.picker.table.replace(found)  # keeps each known worker's load and breaker
        self._listing = (now, found)
        return found

    def _channel(self, address: str) -> TracedChannel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(
                address, default_timeout_s=self.settings.call_timeout_s, max_in_flight=None
            )
        return channel

    async def _index_address(self) -> str:
        return await find_address(
            self.registry,
            "kv-index",
            configured=self.settings.kv_index_addr,
            node=self.settings.resolved_node(),
        )

    async def coordinator(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        """The coordinator to use now (``coordinators.call`` fails over; this does not)."""
        return await self.coordinators.current()

    def _worker(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        # One stub per worker: a stub builds a callable per method, too much per call.
        stub = self._workers.get(address)
        if stub is None:
            stub = self._workers[address] = worker_pb2_grpc.WorkerServiceStub(
                self._channel(address)
            )
        return stub

    # ------------------------------------------------------------ picking

    async def pick(
        self, role: str, operation: str, strategy: str = "", **options: Unpack[PickOptions]
    ) -> Picked:
        """A worker of ``role`` by ``strategy`` ("" or "router": the role's default), its
        call counted on it until ``report``; NotFound when none is live within the wait."""
        if strategy == "router":
            strategy = ""
        backoff = Backoff.within(self.settings.failover_wait_s, BACKOFF_S, MAX_BACKOFF_S)
        while True:
            # The table is at most one catalog_ttl_s old (a restarted worker's new address).
            await self.workers()
            try:
                result = await self.picker.pick(role, strategy, operation=operation, **options)
            except NotFound:
                # No live worker now: with one worker restarting, wait for it on a fresh
                # listing (the caller turns the NotFound left at the end into its 503).
                delay = backoff.next()
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                continue
            worker = result.worker
            ticket = self.picker.table.begin(worker.worker_id, result.prefill_blocks)
            return Picked(worker.worker_id, worker.address, ticket)

    def report(self, picked: Picked, ok: bool, code: str = "") -> None:
        """End a picked call's count on its worker with its outcome (failures feed the
        worker's breaker; a neutral code, e.g. CANCELLED, says nothing of the worker)."""
        self.picker.table.finish(picked.worker_id, picked.ticket, ok, code)

    async def _queue_of(self, worker: WorkerRecord) -> int | None:
        """A worker's running and waiting requests, or None when it does not answer."""
        try:
            reply = await self._worker(worker.address).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=self.settings.load_timeout_s
            )
        except OmniflowError as exc:
            log.debug("GetLoad of %s failed: %s", worker.worker_id, exc.code_name)
            return None
        return reply.load.running_requests + reply.load.waiting_requests

    # ------------------------------------------------------------ workers

    async def generate(self, address: str, call: GenerateCall) -> AsyncIterator[GenChunk]:
        """Stream a worker's Generate; closing the iterator cancels the RPC."""
        rpc = self._worker(address).Generate(
            _request_proto(call), timeout=self.settings.request_timeout_s
        )
        try:
            async for r in rpc:
                chunk = GenChunk(r.text, list(r.token_ids))
                if len(r.logprobs):
                    chunk.logprobs = list(r.logprobs)
                if len(r.top_logprobs):
                    chunk.top_logprobs = [
                        list(zip(t.token_ids, t.logprobs, strict=False)) for t in r.top_logprobs
                    ]
                if r.finish_reason:
                    chunk.finish_reason = finish_from_proto(r.finish_reason, "stop")
                    chunk.prompt_tokens = r.usage.prompt_tokens
                    chunk.cached_tokens = r.usage.cached_tokens
                    chunk.completion_tokens = r.usage.completion_tokens
                yield chunk
        finally:
            rpc.cancel()  # a no-op once the stream ended; ends the call when we stop early

    async def generate_image(
        self, address: str, request_id: str, prompt: str, width: int, height: int, seed: int | None
    ) -> bytes:
        msg = worker_pb2.GenerateImageRequest(
            request_id=request_id, text=prompt, width=width, height=height
        )
        if seed is not None:
            msg.seed = seed
        reply = await self._worker(address).GenerateImage(
            msg, timeout=self.settings.request_timeout_s
        )
        return reply.png

    async def synthesize(
        self, address: str, request_id: str, text: str, voice: str, sample_rate: int = 0
    ) -> bytes:
        """The talker's speech as one WAV file (its own, or one wrapped around its PCM), at
        ``sample_rate`` (0: the talker's default, 16 kHz)."""
        rpc = self._worker(address).Synthesize(
            worker_pb2.SynthesizeRequest(
                request_id=request_id, text=text, voice=voice, sample_rate=sample_rate
            ),
            timeout=self.settings.request_timeout_s,
        )
        wav, pcm, rate = b"", bytearray(), sample_rate or 16000
        try:
            async for chunk in rpc:
                pcm += chunk.pcm_s16le
                rate = chunk.sample_rate or rate
                if chunk.last and chunk.wav:
                    wav = chunk.wav
        finally:
            rpc.cancel()
        return wav or wav_bytes(bytes(pcm), rate)

    async def invoke(
        self, address: str, request_id: str, operation: str, inputs: dict[str, Any]
    ) -> dict[str, Any]:
        """A worker's ``Invoke`` of ``operation`` (embed, transcribe): Python values in and
        out (``omniflow.values``)."""
        msg = worker_pb2.InvokeRequest(
            request_id=request_id,
            operation=operation,
            inputs={k: from_python(v, f"input {k!r}") for k, v in inputs.items()},
        )
        reply = await self._worker(address).Invoke(msg, timeout=self.settings.request_timeout_s)
        return {k: to_python(v) for k, v in reply.outputs.items()}

    # ------------------------------------------------------------ coordinator

    async def workflows(self) -> list[str]:
        req, timeout = coordinator_pb2.ListWorkflowsRequest(), self.settings.pick_timeout_s
        # A listing (GET /v1/models) does not wait for a coordinator: it lists without them.
        reply = await self.coordinators.call(
            lambda s: s.ListWorkflows(req, timeout=timeout), wait_s=0
        )
        return [w.name for w in reply.workflows]

    async def workflow(self, name: str) -> WorkflowInfo:
        req, timeout = coordinator_pb2.GetWorkflowRequest(name=name), self.settings.pick_timeout_s
        reply = await self.coordinators.call(lambda s: s.GetWorkflow(req, timeout=timeout))
        return workflow_info(reply.graph)

    async def run_workflow(
        self,
        name: str,
        inputs: dict[str, Any],
        node_params: dict[str, dict[str, Any]] | None = None,
    ) -> AsyncIterator[RunChunk]:
        """Run a workflow; yields its text and bytes chunks as they stream, then its outputs.

        The run id is made here: when its coordinator stops answering, the run is submitted
        again (idempotent: the same id) to another one and followed from the last event
        seen, so a coordinator's death costs the run nothing it had streamed."""
        req = coordinator_pb2.SubmitRunRequest(
            workflow=name,
            inputs={k: from_python(v, f"input {k!r}") for k, v in inputs.items()},
            deadline_ms=int(self.settings.request_timeout_s * 1000),
            run_id=f"gw-{secrets.token_hex(16)}",
        )
        for node, params in (node_params or {}).items():
            req.node_params[node].CopyFrom(from_python(params, f"{node} params").struct_value)
        timeout = self.settings.request_timeout_s + RUN_STREAM_SLACK_S
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        seen, submitted = 0, False
        backoff = Backoff(BACKOFF_S, MAX_BACKOFF_S, deadline=end)
        pool = self.coordinators
        while True:
            try:
                address = pool.order(await pool.addresses())[0]
            except Unavailable as exc:  # none registered now (its only one restarting): wait
                address, error = "", str(exc)
            else:
                try:
                    async for ev in self._run_chunks(
                        self._run_rpc(pool.stub(address), req, seen, submitted, end)
                    ):
                        if isinstance(ev, int):
                            seen, submitted = ev, True
                            continue
                        yield ev
                        if ev.outputs is not None:
                            return
                    error = "its event stream ended before the run finished"
                except Unavailable as exc:
                    error = str(exc)
                    pool.mark_down(address)
            delay = backoff.next()
            if delay is None:
                raise Unavailable(f"run {req.run_id}: no coordinator reported its end ({error})")
            log.info("run %s: %s (%s); following it on a coordinator", req.run_id, error, address)
            if not submitted:
                # Accepted or not, the id is ours: submitting it again is idempotent.
                await pool.call(lambda s: s.SubmitRun(req, timeout=timeout))
                submitted = True
            await asyncio.sleep(delay)

    @staticmethod
    def _run_rpc(
        stub: Any, req: coordinator_pb2.SubmitRunRequest, seen: int, submitted: bool, end: float
    ) -> Any:
        """The run's event stream on ``stub``: run it, or follow it from after ``seen``."""
        left = max(end - asyncio.get_running_loop().time(), 0.001)
        if not submitted:
            return stub.RunWorkflow(req, timeout=left)
        return stub.StreamRunEvents(
            coordinator_pb2.StreamRunEventsRequest(run_id=req.run_id, from_seq=seen + 1),
            timeout=left,
        )

    async def _run_chunks(self, rpc: Any) -> AsyncIterator[RunChunk | int]:
        """A run's event stream as chunks, and the sequence number of every event."""
        try:
            async for ev in rpc:
                yield ev.seq
                kind = ev.WhichOneof("event")
                if kind == "node_output":
                    o = ev.node_output
                    which = o.chunk.WhichOneof("kind")
                    if which == "text":
                        yield RunChunk(node=o.node, output=o.output, text=o.chunk.text)
                    elif which == "bytes_value":  # a talker's PCM, as it speaks
                        yield RunChunk(node=o.node, output=o.output, data=o.chunk.bytes_value)
                elif kind == "run_finished":
                    f = ev.run_finished
                    outs = {k: to_python(v) for k, v in f.outputs.items()}
                    ok = f.state == coordinator_pb2.RUN_STATE_SUCCEEDED
                    yield RunChunk(outputs=outs, error="" if ok else (f.error or "run failed"))
                    return
        finally:
            rpc.cancel()

    async def close(self) -> None:
        await stop_task(self._health)
        self._health = None
        await self.picker.close()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._workers.clear()


def workflow_info(g: Any) -> WorkflowInfo:
    """What the gateway reads of a registered graph (a compiled ``WorkflowGraph``)."""
    produced = {k: s.node_output for k, s in g.outputs.items() if s.HasField("node_output")}
    nodes = {
        n.name: NodeInfo(
            n.call.role, n.call.operation, {k: to_python(v) for k, v in n.params.items()}
        )
        for n in g.nodes
        if n.WhichOneof("kind") == "call"
    }
    return WorkflowInfo(
        g.name,
        tuple((p.name, int(p.type), p.optional) for p in g.inputs),
        {k: produced[k].node if k in produced else "" for k in g.outputs},
        {k: produced[k].output if k in produced else "" for k in g.outputs},
        {p.name: int(p.type) for p in g.output_ports},
        nodes,
        chat_parts(g),
        output_flow(g),
    )
