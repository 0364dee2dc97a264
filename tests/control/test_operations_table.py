"""The one table of operations (``omniflow.operations``) is what the DSL, the coordinator's
caller, the worker edge and the gateway's workflow mapping read: every operation a worker
serves is in it, and each hop takes an operation's inputs, outputs and params as it says.

The caller is checked against a real worker edge (in-process gRPC, port 0) of a role with
no model loaded: each call reaches the handler of its operation's role, which names that
role when refusing (a call sent to the wrong RPC would be refused with another role)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from inprocess import host_settings

from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.config import load_settings
from omniflow.dsl import VType, Workflow, register_operation, signature
from omniflow.dsl.flow import chat_parts, input_reach
from omniflow.errors import FailedPrecondition, InvalidArgument, Unimplemented
from omniflow.operations import (
    CHAT_PARTS,
    OPERATIONS,
    PHRASE_INPUT_CHARS,
    ROLES,
    RPCS,
    operation,
    served,
)
from omniflow.rpc.server import ServiceHost
from omniflow_services.coordinator.caller import GrpcWorkerCaller, image_request
from omniflow_services.coordinator.calls import CallRequest, Target
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.core import WorkerCore
from omniflow_services.worker.echo.role import STANDS_IN_FOR
from omniflow_services.worker.server import INVOKE, WorkerApp, WorkerServicer

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})

# The WorkerService methods that serve an operation (the rest are control calls).
_CONTROL_RPCS = {"LoadModel", "Abort", "GetLoad", "GetInfo"}
_BASE = worker_pb2_grpc.WorkerServiceServicer
_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]


def _served_by_edge() -> set[tuple[str, str]]:
    """(role, operation) of everything the worker edge serves: what each role's core
    advertises with its model loaded, and the Invoke table (the echo TEST engine's own
    operations are user operations of its test role ``echo``, not built in)."""
    got: set[tuple[str, str]] = set(INVOKE)
    base = load_settings(WorkerSettings, env={})
    for role in ROLES:
        core = WorkerCore(dataclasses.replace(base, role=role))
        core.model = "loaded"  # what the role serves once a model is in (no engine needed)
        got |= {(role, op) for op in core.operations}  # no engine: no sampling features
    # The echo engine serves the operations of the roles it stands in for.
    got |= {(role, op) for role in STANDS_IN_FOR for op in served(role)}
    return got


def test_every_operation_the_worker_serves_is_in_the_table() -> None:
    table = {(op.role, op.name) for op in OPERATIONS}
    edge = _served_by_edge()
    assert edge <= table, f"served by the worker but not in the table: {edge - table}"
    # And every operation of the table is served (transcribe only by a Whisper encoder).
    assert table - edge <= {("encoder", "transcribe")} <= table
    assert served("encoder", model_can=("transcribe",)) == ("encode", "transcribe")
    assert served("encoder") == ("encode",)


def test_the_worker_edge_has_a_handler_for_each_operation() -> None:
    invoke_ops = {(op.role, op.name) for op in OPERATIONS if op.rpc == "Invoke"}
    assert set(INVOKE) == invoke_ops
    for op in OPERATIONS:
        assert op.rpc in RPCS
        # Overridden by the worker's servicer, not the generated UNIMPLEMENTED one.
        assert getattr(WorkerServicer, op.rpc) is not getattr(_BASE, op.rpc), op
        assert op.rpc in _SERVICE.methods_by_name  # the method the caller's stub calls
    serving = {
        name
        for name, fn in vars(WorkerServicer).items()
        if callable(fn) and name[0].isupper() and name not in _CONTROL_RPCS
    }
    assert serving == {op.rpc for op in OPERATIONS}


def test_the_dsl_reads_the_table() -> None:
    for op in OPERATIONS:
        assert signature(op.role, op.name) is op
        wf = Workflow(f"t-{op.role}-{op.name}")
        given = {i.name: wf.input(i.name, i.kind, optional=i.optional) for i in op.inputs}
        node = wf.call("n", op.role, op.name, **given)
        ports = {p.name: (VType(p.type), p.optional) for p in node.proto.input_ports}
        assert ports == {i.name: (i.kind, i.optional) for i in op.inputs}
        assert {p.name: VType(p.type) for p in node.proto.outputs} == op.outputs
        first = next(iter(op.outputs))
        wf.output("out", node[first])
        graph = wf.compile()
        # Each input reaches the call input of its name, and takes its chat part.
        assert input_reach(graph) == {i.name: {(op.role, op.name, i.name)} for i in op.inputs}
        parts = chat_parts(graph)
        for i in op.inputs:
            assert parts[i.name] == ({i.chat} if i.chat else set())
            assert i.chat in ("", *CHAT_PARTS)
    with pytest.raises(InvalidArgument, match=r"llm.generate has no input 'text'; inputs: prompt"):
        Workflow("bad").call("n", "llm", "generate", text="hi")
    with pytest.raises(InvalidArgument, match="role 'llm' is built in"):
        register_operation("llm", "shout", {"text": VType.TEXT}, {"text": VType.TEXT})


def test_phrased_inputs_get_phrases_from_a_stream() -> None:
    for op in OPERATIONS:
        for i in op.inputs:
            if i.kind != VType.TEXT:
                continue
            wf = Workflow("phrases")
            src = wf.call("src", "llm", "generate", prompt=wf.input("q", VType.TEXT))
            node = wf.call("n", op.role, op.name, **{i.name: src["text"].stream()})
            want = PHRASE_INPUT_CHARS if i.phrased else 0
            assert node.proto.inputs[i.name].phrase_chars == want, (op.name, i.name)
    assert operation("llm", "generate").phrased == {"prompt"}  # type: ignore[union-attr]


def test_the_callers_params_are_the_tables() -> None:
    req = CallRequest("r", "diffusion", "generate_image", {"prompt": "a cat"}, {})
    msg = image_request(req)
    op = operation("diffusion", "generate_image")
    assert op is not None
    for p in op.params:
        if p.name == "seed":
            assert not msg.HasField("seed")
        else:
            assert getattr(msg, p.name) == p.default, p.name
    with pytest.raises(InvalidArgument, match="param 'negative_prompt' is int; accepted: a str"):
        image_request(dataclasses.replace(req, params={"negative_prompt": 3}))
    caller = GrpcWorkerCaller(lambda: None, hinter=object())  # type: ignore[arg-type]
    for op in OPERATIONS:
        reads = caller.pick_reads(op.role, op.name, 0)
        assert set(reads) <= {i.name for i in op.inputs}
        assert bool(reads) == bool(op.hints), op.name
        if op.hints:
            assert op.hints in reads


@pytest.fixture
async def bare_worker(private_redis) -> AsyncIterator[ServiceHost]:  # type: ignore[no-untyped-def]
    """A real worker edge of role embed with no model loaded."""
    settings = host_settings(
        WorkerSettings,
        private_redis.url,
        instance_id="embed-bare",
        role="embed",
        model="",
    )
    host = ServiceHost(WorkerApp(settings), settings)
    await host.start()
    try:
        yield host
    finally:
        await host.stop()


_INPUTS = {
    ("llm", "generate"): {"prompt": "hi"},
    ("diffusion", "generate"): {"prompt": "hi"},
    ("encoder", "encode"): {"image": b"\x89PNG"},
    ("encoder", "transcribe"): {"audio": b"RIFF"},
    ("embed", "embed"): {"texts": ["hi"]},
    ("diffusion", "generate_image"): {"prompt": "a cat"},
    ("talker", "synthesize"): {"text": "hi"},
}


async def test_the_caller_reaches_the_handler_of_each_operation(bare_worker) -> None:  # type: ignore[no-untyped-def]
    caller = GrpcWorkerCaller(lambda: None, call_timeout_s=10.0)  # type: ignore[arg-type]
    target = Target("embed-bare", bare_worker.address)
    assert set(_INPUTS) == {(op.role, op.name) for op in OPERATIONS}
    try:
        for (role, name), inputs in _INPUTS.items():
            req = CallRequest(f"r-{name}", role, name, inputs, {}, timeout_s=10.0)
            # The worker's handler for the operation's role refuses: it names that role
            # (generate: the llm role's, which diffusion's backbone shares), or says no
            # model is loaded when the role is this worker's own.
            want = "not 'llm'" if name == "generate" else f"not {role!r}"
            if role == "embed":
                want = "no model is loaded"
            with pytest.raises(FailedPrecondition, match=want):
                await caller.invoke(target, req, None)
        with pytest.raises(Unimplemented, match="user-registered operations"):
            await caller.invoke(target, CallRequest("r", "echo", "upper", {"text": "a"}, {}), None)
    finally:
        await caller.close()
