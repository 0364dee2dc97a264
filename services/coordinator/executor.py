"""The run engine: executes a workflow graph, calling workers through an interface.

No gRPC here: the coordinator's edge implements :class:`WorkerCaller` with the router's
``Pick`` and worker stubs; tests may implement it with anything real. The graph itself
is the ``WorkflowGraph`` message (a typed schema already; a parallel set of dataclasses
would only duplicate it).

Semantics, per node kind:

- call: pick a worker (excluding the ones that failed this node), call it with the
  node's inputs and params; on an error listed in the retry policy, back off and retry
  on another worker, up to ``max_attempts``. ``timeout_ms`` bounds each attempt.
- switch: the first case whose predicate holds runs its body, else the default body.
- loop: run the body with the node's inputs plus ``iteration``; outputs named like
  inputs feed the next iteration; stop when ``until`` holds or at ``max_iterations``.
- map: run the body once per element of the ``over`` input (at most ``max_parallel``
  at once); every output becomes the list of the bodies' outputs.
- streaming edge: the consumer runs once per chunk the producer streams, starting on
  the first; chunks that arrive while it is busy are coalesced into its next call.
  An edge with ``phrase_chars`` hands over whole phrases of the text instead (see
  ``streams.Phrases``): a talker starts on the first phrase, not per token and not after
  the whole answer; the calls run one after another, so the audio stays in order.
  Outputs of the per-chunk calls are joined (text and bytes concatenated, WAV files as
  one WAV, lists extended, other values: the last one).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from omniflow import telemetry
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.dsl.validate import LOOP_ITERATION_INPUT
from omniflow.errors import DeadlineExceeded, OmniflowError
from omniflow.values import to_python
from omniflow_services.coordinator import metrics
from omniflow_services.coordinator.calls import (
    PICK_AHEAD_MAX_AGE_S,
    UNUSED_PICK_CODE,
    CallRequest,
    ChunkSink,
    PickAhead,
    RunSink,
    Target,
    WorkerCaller,
    pick_entries,
    release_picks,
)
from omniflow_services.coordinator.streams import Phrases, join

__all__ = [
    "CallRequest",
    "ChunkSink",
    "Executor",
    "NodeFailed",
    "NodeLimits",
    "PickAhead",
    "RunSink",
    "Target",
    "WorkerCaller",
    "evaluate",
    "pick_entries",
    "release_picks",
]

log = logging.getLogger(__name__)

DEFAULT_RETRY_ON = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


class NodeFailed(OmniflowError):
    """A node failed for good; the run fails with this message (it names the node)."""

    def __init__(self, path: str, reason: str, code_name: str = "INTERNAL") -> None:
        super().__init__(f"node {path!r} failed: {reason}")
        self.path, self.reason, self.code_name = path, reason, code_name


class _Stream:
    """The chunks of one streaming node output, for streaming consumers."""

    def __init__(self) -> None:
        self.chunks: list[Any] = []
        self.closed = False
        self.changed = asyncio.Event()

    def push(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        self.changed.set()

    def close(self) -> None:
        self.closed = True
        self.changed.set()


def _field(value: Any, path: str) -> Any:
    for part in path.split(".") if path else ():
        value = value.get(part) if isinstance(value, dict) else None
    return value


def evaluate(pred: cpb.Predicate, value: Any) -> bool:
    """Whether ``pred`` holds for ``value`` (already resolved from its source)."""
    value = _field(value, pred.field)
    op = pred.op
    if op == cpb.Predicate.OP_PRESENT:
        return value is not None
    if op == cpb.Predicate.OP_TRUTHY:
        return bool(value)
    operand = to_python(pred.operand)
    try:
        if op == cpb.Predicate.OP_EQUALS:
            return bool(value == operand)
        if op == cpb.Predicate.OP_NOT_EQUALS:
            return bool(value != operand)
        if op == cpb.Predicate.OP_LESS:
            return bool(value < operand)
        if op == cpb.Predicate.OP_GREATER:
            return bool(value > operand)
        if op == cpb.Predicate.OP_CONTAINS:
            return value is not None and operand in value
    except TypeError:
        return False  # incomparable values: the condition does not hold
    return False


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a call node's attempts need that does not change between runs."""

    params: dict[str, Any]  # shared by every call of the node: read, never modified
    attempts: int
    retry_on: frozenset[str]
    semaphore: asyncio.Semaphore | None


@dataclass(slots=True)
class NodeLimits:
    """Per-node concurrency limits shared by every run of one workflow version, and the
    nodes' plans (a version's graph never changes)."""

    semaphores: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    plans: dict[str, _Plan] = field(default_factory=dict)
    # Recent duration of each call node (seconds, moving average): a consumer of a node
    # slower than PICK_AHEAD_MAX_AGE_S does not pick ahead (the pick would go stale).
    durations: dict[str, float] = field(default_factory=dict)

    def took(self, path: str, seconds: float) -> None:
        key = _strip_indices(path)
        last = self.durations.get(key)
        self.durations[key] = seconds if last is None else 0.7 * last + 0.3 * seconds

    def slow(self, path: str) -> bool:
        return self.durations.get(_strip_indices(path), 0.0) > PICK_AHEAD_MAX_AGE_S

    def get(self, key: str, limit: int) -> asyncio.Semaphore | None:
        if limit <= 0:
            return None
        sem = self.semaphores.get(key)
        if sem is None:
            sem = self.semaphores[key] = asyncio.Semaphore(limit)
        return sem

    def plan(self, path: str, node: cpb.Node) -> _Plan:
        key = _strip_indices(path)  # every iteration of a loop or map shares one plan
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = _Plan(
                {k: to_python(v) for k, v in node.params.items()},
                max(1, node.retry.max_attempts),
                frozenset(node.retry.retry_on) or DEFAULT_RETRY_ON,
                self.get(key, node.max_concurrency),
            )
        return plan


class _Scope:
    """Values of one (sub)graph execution: its inputs and its nodes' outputs."""

    def __init__(self, inputs: Mapping[str, Any], nodes: list[cpb.Node], prefix: str) -> None:
        self.inputs = dict(inputs)
        self.prefix = prefix
        loop = asyncio.get_running_loop()
        self.done: dict[str, asyncio.Future[dict[str, Any]]] = {
            n.name: loop.create_future() for n in nodes
        }
        # Set when a node's call is under way (or it ended).
        self.calling: dict[str, asyncio.Event] = {n.name: asyncio.Event() for n in nodes}
        # Set when a node's call is under way, or its worker is picked while its own
        # producers are calling: its consumers pick ahead then (at most two nodes ahead).
        self.soon: dict[str, asyncio.Event] = {n.name: asyncio.Event() for n in nodes}
        self.producers: dict[str, set[str]] = {
            n.name: {s.node_output.node for s in n.inputs.values() if s.HasField("node_output")}
            for n in nodes
        }

        self.streams: dict[tuple[str, str], _Stream] = {}
        for node in nodes:
            for src in node.inputs.values():
                if src.streaming and src.HasField("node_output"):
                    key = (src.node_output.node, src.node_output.output)
                    self.streams.setdefault(key, _Stream())

    def started(self, name: str) -> None:
        self.calling[name].set()
        self.soon[name].set()

    def picked(self, name: str, task: asyncio.Future[Any]) -> None:
        """``name``'s pick ahead completed: its consumers may pick too, if its own
        producers already run (so that picks never cascade down a whole chain)."""
        if task.cancelled() or task.exception() is not None:
            return
        if all(self.calling[p].is_set() for p in self.producers[name]):
            self.soon[name].set()

    async def resolve(self, src: cpb.Source) -> Any:
        kind = src.WhichOneof("kind")
        if kind == "graph_input":
            return self.inputs.get(src.graph_input)
        if kind == "node_output":
            # Awaited directly, not through asyncio.shield (one loop turn less per hop): a
            # consumer is only cancelled together with its whole scope, producers
            # included, and producers settle their future only if it is not done yet.
            outputs = await self.done[src.node_output.node]
            return outputs.get(src.node_output.output)
        return to_python(src.constant)


class Executor:
    """Runs one workflow run's graph."""

    def __init__(
        self,
        caller: WorkerCaller,
        sink: RunSink,
        run_id: str,
        limits: NodeLimits,
        deadline: float | None = None,
        early: dict[str, PickAhead] | None = None,
        max_backoff_s: float = 30.0,
        overrides: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        self.caller, self.sink, self.run_id = caller, sink, run_id
        self.overrides = overrides or {}  # top-level node -> params over its own, this run
        self.limits = limits
        self.early = early or {}  # picks made before the run started (``pick_entries``)
        self.deadline = deadline  # loop time
        self.max_backoff_s = max_backoff_s  # whatever a node's retry policy asks
        self._seq = 0
        # Node-call request ids carry randomness made here: a run id is the client's
        # choice, and a worker's Abort must not be aimed at calls by guessing their ids.
        self._nonce = secrets.token_hex(8)

    async def run(
        self,
        inputs: Mapping[str, Any],
        nodes: list[cpb.Node],
        outputs: Mapping[str, cpb.Source],
        prefix: str = "",
    ) -> dict[str, Any]:
        """Execute a (sub)graph; returns its outputs. Raises NodeFailed."""
        scope = _Scope(inputs, nodes, prefix)
        try:
            async with asyncio.TaskGroup() as group:
                for node in nodes:
                    group.create_task(self._node(scope, node))
        except* NodeFailed as eg:
            raise eg.exceptions[0] from None
        return {key: await scope.resolve(src) for key, src in outputs.items()}

    # -- nodes
    async def _node(self, scope: _Scope, node: cpb.Node) -> None:
        path = scope.prefix + node.name
        future = scope.done[node.name]
        try:
            streaming = {k: s for k, s in node.inputs.items() if s.streaming}
            plain = {k: s for k, s in node.inputs.items() if not s.streaming}
            kind = node.WhichOneof("kind")
            ahead = None
            if kind == "call" and not streaming:
                ahead = self.early.pop(node.name, None) if not scope.prefix else None
                ahead = ahead or await self._pick_ahead(scope, node)
                if ahead is not None:
                    ahead.task.add_done_callback(lambda t, n=node.name: scope.picked(n, t))
            values = dict(zip(plain, [await scope.resolve(s) for s in plain.values()], strict=True))
            started = time.perf_counter()
            if kind == "call" and streaming:
                out = await self._call_streaming(scope, node, path, values, streaming)
            elif kind == "call":
                out = await self._call(scope, node, path, values, ahead)
            else:
                self.sink.node_started(path, "", 1)
                if kind == "switch":
                    out = await self._switch(scope, node, path, values)
                elif kind == "loop":
                    out = await self._loop(node, path, values)
                else:
                    out = await self._map(node, path, values)
                self.sink.node_finished(
                    path, cpb.RUN_STATE_SUCCEEDED, "", (time.perf_counter() - started) * 1e3
                )
            if not future.done():
                future.set_result(out)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except NodeFailed as exc:
            _settle(future, exc)
            if exc.path == path:
                self.sink.node_finished(path, cpb.RUN_STATE_FAILED, exc.reason, 0.0)
            elif exc.path.startswith((path + "/", path + "[")):
                self.sink.node_finished(path, cpb.RUN_STATE_FAILED, str(exc), 0.0)
            # else: an upstream node failed; this one never ran.
            raise
        except Exception as exc:
            # A bug or an unexpected error: fail the node rather than hang the run.
            log.exception("node %s of run %s", path, self.run_id)
            failed = NodeFailed(path, f"{type(exc).__name__}: {exc}")
            _settle(future, failed)
            self.sink.node_finished(path, cpb.RUN_STATE_FAILED, failed.reason, 0.0)
            raise failed from exc
        finally:
            scope.started(node.name)
            for (name, _), stream in scope.streams.items():
                if name == node.name:
                    stream.close()

    def _timeout(self, node: cpb.Node) -> float | None:
        left = None if self.deadline is None else self.deadline - asyncio.get_running_loop().time()
        per_node = node.timeout_ms / 1000 if node.timeout_ms else None
        options = [t for t in (left, per_node) if t is not None]
        return max(min(options), 0.0) if options else None

    async def _pick_ahead(self, scope: _Scope, node: cpb.Node) -> PickAhead | None:
        """Pick this node's worker while its producer runs, so that a hop costs one RPC
        on the critical path instead of two. Not when the pick depends on a value the
        run has yet to produce (a session key from a node output)."""
        producers = scope.producers[node.name]
        if not producers or any(self.limits.slow(scope.prefix + p) for p in producers):
            return None
        spec = node.call
        key_src = node.inputs.get(spec.session_key_input) if spec.session_key_input else None
        if key_src is not None and key_src.HasField("node_output"):
            return None
        reads = {
            name: node.inputs[name]
            for name in self.caller.pick_reads(spec.role, spec.operation, spec.strategy)
            if name in node.inputs
        }
        if any(src.HasField("node_output") for src in reads.values()):
            return None
        for name in producers:
            await scope.soon[name].wait()
        session = ""
        if key_src is not None:
            session = str(await scope.resolve(key_src) or "")
        inputs = {name: await scope.resolve(src) for name, src in reads.items()}
        req = CallRequest(
            "", spec.role, spec.operation, inputs, {}, spec.strategy, session, self._timeout(node)
        )
        loop = asyncio.get_running_loop()
        return PickAhead(asyncio.ensure_future(self.caller.pick(req, ())), loop.time())

    async def _take_ahead(self, ahead: PickAhead | None) -> Target | None:
        """The picked-ahead worker if the pick is fresh and succeeded; else None (and a
        stale pick is released so that the router does not count it as outstanding)."""
        if ahead is None:
            return None
        try:
            target = await ahead.task
        except OmniflowError:
            return None  # pick again, with the error handling of a normal pick
        if asyncio.get_running_loop().time() - ahead.at > PICK_AHEAD_MAX_AGE_S:
            await self.caller.report(target, False, 0.0, UNUSED_PICK_CODE)
            return None
        return target

    async def _call(
        self,
        scope: _Scope,
        node: cpb.Node,
        path: str,
        values: dict[str, Any],
        ahead: PickAhead | None = None,
    ) -> dict[str, Any]:
        spec = node.call
        session = values.get(spec.session_key_input) if spec.session_key_input else ""
        plan = self.limits.plan(path, node)
        params, attempts, retry_on, sem = plan.params, plan.attempts, plan.retry_on, plan.semaphore
        params = {**params, **self.overrides[path]} if path in self.overrides else params
        backoff = node.retry.initial_backoff_ms / 1000
        exclude: list[str] = []
        outs = {k: s for k, s in scope.streams.items() if k[0] == node.name}
        delivered = False

        async def on_chunk(output: str, chunk: Any) -> None:
            nonlocal delivered
            self.sink.node_output(path, output, chunk)
            stream = outs.get((node.name, output))
            if stream is not None:
                delivered = True
                stream.push(chunk)

        with telemetry.tracer().start_as_current_span(f"node {path}") as span:
            span.set_attribute("omniflow.node", path)
            for attempt in range(1, attempts + 1):
                self._seq += 1
                req = CallRequest(
                    request_id=f"{self.run_id}:{self._nonce}:{path}:{attempt}:{self._seq}",
                    role=spec.role,
                    operation=spec.operation,
                    inputs=values,
                    params=params,
                    strategy=spec.strategy,
                    session_key=str(session or ""),
                    timeout_s=self._timeout(node),
                )
                started = time.perf_counter()
                target: Target | None = None
                try:
                    if sem is not None:
                        await sem.acquire()
                    try:
                        target = await self._take_ahead(ahead) if attempt == 1 else None
                        if target is None:
                            target = await self.caller.pick(req, tuple(exclude))
                        self.sink.node_started(path, target.worker_id, attempt)
                        scope.started(node.name)  # consumers pick ahead while it runs
                        async with asyncio.timeout(req.timeout_s):
                            result = await self.caller.invoke(target, req, on_chunk)
                    finally:
                        if sem is not None:
                            sem.release()
                except TimeoutError:
                    error: OmniflowError = DeadlineExceeded(
                        f"no answer within {req.timeout_s:.3f} s"
                    )
                except OmniflowError as exc:
                    error = exc
                else:
                    elapsed = (time.perf_counter() - started) * 1e3
                    self.limits.took(path, elapsed / 1e3)
                    metrics.node_called(spec.role, spec.operation, "OK", elapsed / 1e3)
                    await self.caller.report(target, True, elapsed, "")
                    for (_, output), stream in outs.items():
                        if not stream.chunks and output in result:
                            stream.push(result[output])  # a unary producer: one chunk
                    self.sink.node_finished(path, cpb.RUN_STATE_SUCCEEDED, "", elapsed)
                    return result
                elapsed = (time.perf_counter() - started) * 1e3
                metrics.node_called(spec.role, spec.operation, error.code_name, elapsed / 1e3)
                where = f" on worker {target.worker_id}" if target else ""
                if target is not None:
                    await self.caller.report(target, False, elapsed, error.code_name)
                    exclude.append(target.worker_id)
                last = attempt == attempts or error.code_name not in retry_on or delivered
                span.add_event("attempt failed", {"attempt": attempt, "code": error.code_name})
                if last:
                    tries = f" after {attempt} attempt{'s' if attempt > 1 else ''}"
                    raise NodeFailed(
                        path, f"{error.code_name}: {error}{where}{tries}", error.code_name
                    )
                log.info(
                    "run %s node %s attempt %d%s: %s", self.run_id, path, attempt, where, error
                )
                await asyncio.sleep(min(backoff, self.max_backoff_s))
                backoff = min(backoff * (node.retry.backoff_multiplier or 1.0), self.max_backoff_s)
        raise AssertionError("unreachable")

    async def _call_streaming(
        self,
        scope: _Scope,
        node: cpb.Node,
        path: str,
        values: dict[str, Any],
        streaming: dict[str, cpb.Source],
    ) -> dict[str, Any]:
        """One call per batch of producer chunks, starting on the first."""
        (key, src), *rest = streaming.items()
        for other_key, other in rest:  # only one input streams; the others are waited for
            values[other_key] = await scope.resolve(other)
        stream = scope.streams[(src.node_output.node, src.node_output.output)]
        phrases = Phrases(src.phrase_chars) if src.phrase_chars else None
        taken = 0
        results: list[dict[str, Any]] = []
        while True:
            while taken == len(stream.chunks) and not stream.closed:
                stream.changed.clear()
                await stream.changed.wait()
            if taken == len(stream.chunks) and (phrases is None or not phrases.pending):
                break
            batch = join(stream.chunks[taken:])
            taken = len(stream.chunks)
            if phrases is not None:
                if not isinstance(batch, str | None):
                    raise NodeFailed(path, f"input {key!r}: phrases need a text stream")
                batch = phrases.feed(batch or "")
                if stream.closed and taken == len(stream.chunks):
                    batch += phrases.rest()
                if not batch.strip():
                    continue  # no whole phrase yet (or only whitespace left)
            results.append(await self._call(scope, node, path, {**values, key: batch}))
        # A producer that failed closes its stream too; its failure cancels this task.
        await scope.resolve(cpb.Source(node_output=src.node_output))
        names = {k for r in results for k in r}
        spaced = phrases is not None  # one answer per phrase
        return {k: join([r[k] for r in results if k in r], spaced) for k in names}

    async def _switch(
        self, scope: _Scope, node: cpb.Node, path: str, values: dict[str, Any]
    ) -> dict[str, Any]:
        chosen, name = node.switch.default_body, "default"
        for case in node.switch.cases:
            if evaluate(case.when, await scope.resolve(case.when.value)):
                chosen, name = case.body, case.name
                break
        self.sink.node_output(path, "case", name)
        return await self.run(values, list(chosen.nodes), chosen.outputs, f"{path}/{name}/")

    async def _loop(self, node: cpb.Node, path: str, values: dict[str, Any]) -> dict[str, Any]:
        spec = node.loop
        state = dict(values)
        outs: dict[str, Any] = {}
        for i in range(spec.max_iterations):
            outs = await self.run(
                {**state, LOOP_ITERATION_INPUT: i},
                list(spec.body.nodes),
                spec.body.outputs,
                f"{path}[{i}]/",
            )
            state.update({k: v for k, v in outs.items() if k in state})
            if evaluate(spec.until, outs.get(spec.until.value.graph_input)):
                break
        return outs

    async def _map(self, node: cpb.Node, path: str, values: dict[str, Any]) -> dict[str, Any]:
        spec = node.map
        items = values.get(spec.over)
        if not isinstance(items, list):
            raise NodeFailed(path, f"input {spec.over!r} is not a list", "INVALID_ARGUMENT")
        sem = asyncio.Semaphore(spec.max_parallel) if spec.max_parallel else None

        async def one(i: int, item: Any) -> dict[str, Any]:
            if sem is None:
                return await self.run(
                    {**values, spec.over: item},
                    list(spec.body.nodes),
                    spec.body.outputs,
                    f"{path}[{i}]/",
                )
            async with sem:
                return await self.run(
                    {**values, spec.over: item},
                    list(spec.body.nodes),
                    spec.body.outputs,
                    f"{path}[{i}]/",
                )

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i, item)) for i, item in enumerate(items)]
        except* NodeFailed as eg:
            raise eg.exceptions[0] from None
        results = [t.result() for t in tasks]
        return {p.name: [r.get(p.name) for r in results] for p in node.outputs}


def _settle(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
        future.exception()  # retrieved: consumers are cancelled with the group anyway


def _strip_indices(path: str) -> str:
    """``each[3]/call`` → ``each/call``: one concurrency limit for every iteration."""
    out, depth = [], 0
    for ch in path:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.trace_id else ""
