"""The one sampling contract (``omniflow.sampling``): every field survives each hop, the three
paths (gateway, coordinator, worker) build the same params, defaults are decided once, and
bad values are refused naming the field and its range. Unit tests: no network."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.errors import InvalidArgument
from omniflow.sampling import (
    FIELDS,
    NODE_DEFAULTS,
    SamplingError,
    SamplingParams,
    StructuredOutput,
)
from omniflow_services.coordinator.caller import sampling_params as node_sampling
from omniflow_services.gateway.protocol import ChatCompletionRequest, CompletionRequest

HELLO = [{"role": "user", "content": "hi"}]

#: A value other than the default for every contract field, as a client sends it (JSON).
EVERY_FIELD: dict[str, Any] = {
    "max_tokens": 7,
    "temperature": 0.7,
    "top_k": 5,
    "top_p": 0.9,
    "min_p": 0.05,
    "repetition_penalty": 1.3,
    "seed": 11,
    "stop_token_ids": [9, 4],
    "stop": ["end", "fin"],
    "ignore_eos": True,
    "presence_penalty": 0.4,
    "frequency_penalty": -0.6,
    "logprobs": True,
    "top_logprobs": 3,
    "min_tokens": 2,
    "logit_bias": {"12": 5.5, "3": -100},
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "structured": {"kind": "choice", "spec": '["yes", "no"]'},
}


def test_the_table_names_every_field_and_the_proto_carries_each() -> None:
    assert set(EVERY_FIELD) == set(FIELDS)
    proto = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert set(FIELDS) == proto, "a field the contract or the proto lacks"
    default = SamplingParams()
    built = SamplingParams.build(**EVERY_FIELD)
    for name in FIELDS:
        assert getattr(built, name) != getattr(default, name), name


def test_every_field_survives_the_proto_both_ways() -> None:
    built = SamplingParams.build(**EVERY_FIELD)
    wire = common_pb2.SamplingParams.FromString(built.to_proto().SerializeToString())
    assert SamplingParams.from_proto(wire) == built
    assert SamplingParams.from_proto(SamplingParams().to_proto()) == SamplingParams()


def test_the_three_paths_build_the_same_params() -> None:
    """Gateway (protocol model → contract), coordinator (node params → proto) and worker
    (proto → contract) agree field for field."""
    structured = StructuredOutput("choice", '["yes", "no"]')
    body = {k: v for k, v in EVERY_FIELD.items() if k != "structured"}
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **body})
    gateway = chat.to_sampling_params(structured)
    worker_from_gateway = SamplingParams.from_proto(
        common_pb2.SamplingParams.FromString(gateway.to_proto().SerializeToString())
    )
    worker_from_node = SamplingParams.from_proto(node_sampling(dict(EVERY_FIELD)))
    assert gateway == worker_from_gateway == worker_from_node
    body_c = {**body, "logprobs": 3}
    body_c.pop("top_logprobs")
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", **body_c})
    assert completion.to_sampling_params(structured) == gateway


def test_defaults_are_decided_once() -> None:
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO})
    assert chat.to_sampling_params() == SamplingParams()
    assert SamplingParams().max_tokens is None  # up to the context
    nulled = {"model": "m", "messages": HELLO, "max_tokens": None, "temperature": None}
    assert ChatCompletionRequest.model_validate(nulled).to_sampling_params() == SamplingParams()
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert comp.to_sampling_params().max_tokens == 16  # vLLM's completions default
    node = SamplingParams.from_params({"chat": True, "system": "s"})
    assert (node.max_tokens, node.temperature) == (
        NODE_DEFAULTS["max_tokens"],
        NODE_DEFAULTS["temperature"],
    )
    assert SamplingParams.from_params({"max_tokens": 0}).max_tokens is None
    wire_unset = SamplingParams.from_proto(common_pb2.SamplingParams())
    assert wire_unset.max_tokens is None and wire_unset.skip_special_tokens


def test_max_tokens_is_resolved_against_the_context() -> None:
    """vLLM 0.32's rules: unset is the room the prompt leaves, more than the room is cut to
    it, more than the whole context is refused."""
    p = SamplingParams()
    assert p.resolved(10, 100).max_tokens == 90
    assert SamplingParams(max_tokens=90).resolved(10, 100).max_tokens == 90
    assert SamplingParams(max_tokens=100).resolved(10, 100).max_tokens == 90
    with pytest.raises(SamplingError) as err:
        SamplingParams(max_tokens=101).resolved(10, 100)
    assert err.value.field == "max_tokens" and "context length 100" in str(err.value)
    with pytest.raises(SamplingError) as err:
        p.resolved(100, 100)
    assert err.value.field == "prompt"
    with pytest.raises(SamplingError) as err:
        SamplingParams(min_tokens=95).resolved(10, 100)
    assert err.value.field == "min_tokens"


def test_eos_ids_stop_unless_ignore_eos() -> None:
    p = SamplingParams(stop_token_ids=(4,))
    assert p.with_eos([2, 4]).stop_token_ids == (4, 2)
    ignoring = SamplingParams(ignore_eos=True, stop_token_ids=(4,))
    assert ignoring.with_eos([2]).stop_token_ids == (4,)


@pytest.mark.parametrize(
    ("values", "field", "needle"),
    [
        ({"max_tokens": 2**63}, "max_tokens", "too large"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"temperature": -0.1}, "temperature", "[0, 100]"),
        ({"temperature": float("nan")}, "temperature", "[0, 100]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "[0,"),
        ({"min_p": 2}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "(0, 10]"),
        ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
        ({"seed": 2**63}, "seed", "2^63"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "[0, 20]"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "at most max_tokens"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop": 3}, "stop", "string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "token id"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "token id"),
        ({"logit_bias": {"1": "x"}}, "logit_bias", "number"),
        ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
        ({"structured": {"kind": "yaml", "spec": "x"}}, "structured", "not one of"),
        ({"structured": {"kind": "choice", "spec": "[1]"}}, "structured", "strings"),
        ({"structured": {"kind": "json", "spec": "{"}}, "structured", "not valid JSON"),
        ({"structured": {"kind": "regex"}}, "structured", "needs a spec"),
        ({"nucleus": 1}, "nucleus", "not a sampling field"),
    ],
)
def test_bad_values_name_the_field(values: dict[str, Any], field: str, needle: str) -> None:
    with pytest.raises(SamplingError) as err:
        SamplingParams.build(**values)
    assert err.value.field == field
    assert needle in str(err.value)


def test_vocabulary_checks_need_the_vocabulary() -> None:
    for values, field in (
        ({"stop_token_ids": [50]}, "stop_token_ids"),
        ({"logit_bias": {"50": 1.0}}, "logit_bias"),
        ({"top_k": 51}, "top_k"),
    ):
        p = SamplingParams.build(**values)  # no vocabulary known here: ids are only ids
        p.validate(51)
        with pytest.raises(SamplingError) as err:
            p.validate(50)
        assert err.value.field == field


def test_loose_values_are_normalised() -> None:
    p = SamplingParams.build(stop="x", top_k=-1, logit_bias={"7": 500, 2: -3}, temperature=1)
    assert p.stop == ("x",) and p.top_k == 0
    assert p.logit_bias == ((2, -3.0), (7, 100.0))  # sorted, clamped as vLLM does
    assert isinstance(p.temperature, float)


def test_node_params_errors_name_the_param() -> None:
    with pytest.raises(SamplingError, match="param 'max_tokens'"):
        SamplingParams.from_params({"max_tokens": "ten"})
    spec = json.dumps({"type": "object"})
    p = SamplingParams.from_params({"structured": {"kind": "json", "spec": spec}})
    assert p.structured == StructuredOutput("json", spec)


def test_a_run_sets_params_of_named_top_level_nodes_only() -> None:
    from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
    from omniflow.values import from_python
    from omniflow_services.coordinator.caller import node_overrides

    graph = cpb.WorkflowGraph(name="wf")
    node = graph.nodes.add(name="answer")
    node.call.role, node.call.operation = "llm", "generate"
    params = from_python({"temperature": 0.5, "stop": ["x"]}, "p").struct_value
    assert node_overrides(graph, {"answer": params}) == {
        "answer": {"temperature": 0.5, "stop": ["x"]}
    }
    with pytest.raises(InvalidArgument, match="not a top-level call node"):
        node_overrides(graph, {"other": params})
