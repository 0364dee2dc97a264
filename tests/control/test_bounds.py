"""Bounds the coordinator and the router's breaker keep: workflow input sizes, graph size
and depth (each error names its setting), and picks made ahead and never used released
as neutral (neither a success that resets a failing worker's count nor a failure).
Units with no network, plus one check through real processes."""

from __future__ import annotations

import time

import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.client import Client
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.errors import InvalidArgument
from omniflow.routing.table import WorkerTable
from omniflow.workers import WorkerRecord
from omniflow_services.coordinator.calls import UNUSED_PICK_CODE
from omniflow_services.coordinator.limits import (
    RunLimits,
    check_graph,
    check_inputs_size,
    graph_shape,
)

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})


def _nested(depth: int) -> Workflow:
    """A loop inside a loop ... ``depth - 1`` levels deep, one call at the bottom."""
    wf = Workflow(f"nested{depth}")
    t = wf.input("t", VType.TEXT)

    def body(level: int):
        def make(g):
            if level == 1:
                return {"t": g.call("leaf", "echo", "upper", text=g.input("t"))["text"]}
            inner = g.loop(
                f"l{level}", body=body(level - 1), until=lambda o: o["t"].contains("x"),
                max_iterations=2, t=g.input("t"),
            )  # fmt: skip
            return {"t": inner["t"]}

        return make

    if depth == 1:
        wf.output("t", wf.call("leaf", "echo", "upper", text=t)["text"])
    else:
        top = wf.loop(
            "top", body=body(depth - 1), until=lambda o: o["t"].contains("x"),
            max_iterations=2, t=t,
        )  # fmt: skip
        wf.output("t", top["t"])
    return wf


def test_graph_shape_counts_every_body() -> None:
    assert graph_shape(list(_nested(1).compile().nodes)) == (1, 1)
    assert graph_shape(list(_nested(4).compile().nodes)) == (4, 4)


def test_graph_limits_name_their_settings() -> None:
    graph = _nested(5).compile()
    check_graph(RunLimits(), graph)
    with pytest.raises(InvalidArgument, match=r"nesting depth .* is 5; the limit is 4 .*"
                       r"OMNIFLOW_COORDINATOR_MAX_GRAPH_DEPTH"):  # fmt: skip
        check_graph(RunLimits(max_graph_depth=4), graph)
    with pytest.raises(InvalidArgument, match=r"number of nodes .* is 5; the limit is 3 .*"
                       r"OMNIFLOW_COORDINATOR_MAX_GRAPH_NODES"):  # fmt: skip
        check_graph(RunLimits(max_graph_nodes=3), graph)
    with pytest.raises(InvalidArgument, match="OMNIFLOW_COORDINATOR_MAX_GRAPH_BYTES"):
        check_graph(RunLimits(max_graph_bytes=64), graph)


def test_input_limits_name_their_settings() -> None:
    limits = RunLimits(max_inline_bytes=1000, max_input_bytes=2500)
    small = {f"k{i}": common_pb2.Value(text="x" * 900) for i in range(2)}
    check_inputs_size(limits, small)
    with pytest.raises(InvalidArgument, match=r"input 'big' \(text, inline\).*limit is 1000.*"
                       r"OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES"):  # fmt: skip
        check_inputs_size(limits, {"big": common_pb2.Value(text="x" * 2000)})
    with pytest.raises(InvalidArgument, match="OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES"):
        check_inputs_size(limits, {"b": common_pb2.Value(bytes_value=b"x" * 2000)})
    many = {f"k{i}": common_pb2.Value(text="x" * 900) for i in range(3)}
    with pytest.raises(
        InvalidArgument, match=r"all inputs together.*OMNIFLOW_COORDINATOR_MAX_INPUT_BYTES"
    ):
        check_inputs_size(limits, many)


def _one_worker(**kw) -> WorkerTable:
    t = WorkerTable(seed=1, **kw)
    t.replace([WorkerRecord("w0", "llm", "127.0.0.1:9000", node="n", operations=("generate",))])
    return t


def test_unused_picks_are_released_as_neutral() -> None:
    t = _one_worker(breaker_threshold=2, breaker_cooldown_s=0.05)
    t.finish("w0", t.begin("w0"), False, "UNAVAILABLE")
    t.finish("w0", t.begin("w0"), False, UNUSED_PICK_CODE)  # picked ahead, never used
    t.finish("w0", t.begin("w0"), False, "UNAVAILABLE")
    # Counted as a success, the released pick would have reset the count: still closed.
    assert t.breakers()["w0"] == "open"
    time.sleep(0.06)
    trial = t.pick("llm", "round_robin")  # half-open: this pick is the one trial
    assert trial.worker.worker_id == "w0"
    breaker = t._workers["w0"].breaker
    assert breaker is not None and not breaker.allows(time.monotonic())  # one trial out
    t.finish("w0", None, False, UNUSED_PICK_CODE)  # the trial was never used
    assert t.breakers()["w0"] == "half_open"  # not closed by a call that never ran
    assert breaker.allows(time.monotonic())  # and the next pick may be the trial


@pytest.mark.integration
async def test_coordinator_refuses_an_oversized_input(cluster) -> None:
    procs = cluster({"echo": 1}, coordinator_env={"OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES": "1000"})
    wf = Workflow("shout")
    wf.output("text", wf.call("up", "echo", "upper", text=wf.input("text", VType.TEXT))["text"])
    async with Client(procs["coordinator"].address) as client:
        await client.register(wf)
        with pytest.raises(InvalidArgument, match="OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES"):
            await client.run("shout", {"text": "x" * 5000})
        assert (await client.run("shout", {"text": "ok"})).outputs == {"text": "OK"}
