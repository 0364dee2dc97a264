"""Structured output on the vLLM engine backend: a worker with ``OMNIFLOW_WORKER_ENGINE=vllm``
(from vLLM's virtualenv, on CPU) hands the request's ``StructuredOutput`` to vLLM's own
structured outputs; every answer is checked by ``jsonschema`` / Python's ``re``, and a
constraint vLLM refuses is INVALID_ARGUMENT naming ``structured.<kind>``."""

from __future__ import annotations

import json
import re

import pytest
from vllm_cluster import VLLMCluster

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.chat import Preprocessor
from omniflow.errors import InvalidArgument
from omniflow.rpc.client import open_channel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]
jsonschema = pytest.importorskip("jsonschema", reason="the schema reference (dev extra)")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.fixture(scope="module")
def worker(vllm_cluster: VLLMCluster) -> str:
    agent = vllm_cluster.agent("node-a").wait_ready()
    return vllm_cluster.vllm_worker("llm-a", "node-a", agent.address).wait_ready(600).address


def chat_ids(cluster: VLLMCluster, text: str) -> list[int]:
    pre = Preprocessor.from_folder(cluster.model, bytes(16))
    return pre.encode_chat([{"role": "user", "content": text}])


async def answer(address: str, ids: list[int], kind: str, spec: str, rid: str, **kw) -> str:
    sampling = common_pb2.SamplingParams(**{"max_tokens": 96, "temperature": 0.0, **kw})
    sampling.structured.CopyFrom(common_pb2.StructuredOutput(kind=kind, spec=spec))
    text = []
    last = None
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb2.GenerateRequest(
            request_id=rid, token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling
        )
        async for reply in stub.Generate(request, timeout=300):
            text.append(reply.text)
            last = reply
    assert last is not None and last.finish_reason == worker_pb2.FINISH_REASON_STOP
    return "".join(text)


async def test_vllm_applies_each_kind(worker: str, vllm_cluster: VLLMCluster) -> None:
    person = chat_ids(vllm_cluster, "Describe a person as JSON.")
    text = await answer(worker, person, "json", json.dumps(SCHEMA), "so-json")
    jsonschema.validate(json.loads(text), SCHEMA)
    sampled = await answer(
        worker, person, "json", json.dumps(SCHEMA), "so-seed", temperature=1.0, seed=3
    )
    jsonschema.validate(json.loads(sampled), SCHEMA)
    obj = await answer(worker, person, "json_object", "", "so-obj")
    assert isinstance(json.loads(obj), dict)
    when = chat_ids(vllm_cluster, "When did Apollo 11 land?")
    assert re.fullmatch(DATE, await answer(worker, when, "regex", DATE, "so-re"))
    pick = await answer(worker, when, "choice", json.dumps(["1969", "1970"]), "so-choice")
    assert pick in ("1969", "1970")
    yes = await answer(worker, when, "grammar", 'root ::= "yes" | "no"', "so-ebnf")
    assert yes in ("yes", "no")


async def test_a_constraint_vllm_refuses_names_its_kind(
    worker: str, vllm_cluster: VLLMCluster
) -> None:
    ids = chat_ids(vllm_cluster, "Hello")
    # The channel maps INVALID_ARGUMENT to the domain error (omniflow.rpc.status).
    with pytest.raises(InvalidArgument) as info:
        await answer(worker, ids, "regex", "(ab", "so-bad")
    assert str(info.value).startswith("structured.regex")
