"""KV hints through the coordinator: the Pick of an llm generate call carries the prompt's
block hashes, so ``kv_aware`` routes a prompt to the worker whose device pool holds its
pages. Real processes: kv-index, one kv-agent per node, two llm workers (built-in engine,
tiny qwen2) on two nodes, router and coordinator, on a private Redis. The fallbacks are
unit tests of the hinter (no network)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.client import Client
from omniflow.discovery import make_registry
from omniflow.dsl import VType, Workflow
from omniflow.kv.blocks import block_hashes
from omniflow.localredis import RedisProcess
from omniflow.models.resolve import resolve_model
from omniflow.rpc.client import open_channel
from omniflow.workers import WORKER_SERVICE, WorkerRecord, worker_from_instance
from omniflow_services.coordinator import kvhints
from omniflow_services.coordinator.kvhints import KVHinter

SHM = Path("/dev/shm")

# Two long prompts with nothing in common from the first page on.
PROMPT_P = " ".join(f"page{i} holds keys and values of layer {i % 7}" for i in range(24))
PROMPT_Q = " ".join(f"quiet river {i} carries stones to the sea {i % 5}" for i in range(24))


def record(model: str, namespace: str, role: str = "llm") -> WorkerRecord:
    return WorkerRecord("w-1", role, "127.0.0.1:1", "n", model=model, kv_namespace=namespace)


async def test_hints_fall_back_and_count_when_the_tokenizer_cannot_be_read(tmp_path):
    async def workers() -> list[WorkerRecord]:
        return [record(str(tmp_path / "no-such-model"), "ab" * 16)]

    hinter = KVHinter(workers)
    assert await hinter.hints("llm", PROMPT_P) is None
    assert await hinter.hints("llm", PROMPT_P) is None  # the failure is remembered
    assert hinter.counts[kvhints.NO_TOKENIZER] == 2 and not hinter.counts[kvhints.HINTED]


async def test_hints_fall_back_without_a_worker_namespace(tmp_path):
    async def workers() -> list[WorkerRecord]:
        return [record("", ""), record(str(tmp_path), "ab" * 16, role="encoder")]

    hinter = KVHinter(workers)
    assert await hinter.hints("llm", PROMPT_P) is None
    assert hinter.counts == {kvhints.NO_WORKERS: 1}


async def test_hints_of_a_tiny_model(tmp_path):
    folder = resolve_model("tiny:qwen2", tmp_path / "models")
    namespace = "cd" * 16

    async def workers() -> list[WorkerRecord]:
        return [record(str(folder), namespace)]

    hinter = KVHinter(workers)
    hints = await hinter.hints("llm", PROMPT_P)
    assert hints is not None and hints.namespace == bytes.fromhex(namespace)
    assert len(hints.block_hashes) == hints.prompt_tokens // 16 >= 4
    assert await hinter.hints("llm", "hi") is not None  # under a page: no hashes, counted
    assert hinter.counts == {kvhints.HINTED: 1, kvhints.SHORT: 1}
    again = await hinter.hints("llm", PROMPT_P)
    assert again == hints
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT_P).ids
    assert list(hints.block_hashes) == block_hashes(bytes.fromhex(namespace), ids, 16)


async def _generate_on(address: str, prompt: str) -> list[bytes]:
    """Warm one worker with ``prompt`` (a direct call); returns the prompt's block hashes
    as the worker computed them."""
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        hashes: list[bytes] = []
        async for chunk in stub.Generate(
            worker_pb2.GenerateRequest(
                text=prompt, sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
            ),
            timeout=60,
        ):
            hashes.extend(chunk.prompt_block_hashes)
    return hashes


async def _wait_held(index: str, namespace: str, hashes: list[bytes], owner: str) -> None:
    """Until the index says ``owner``'s device pool holds every block of ``hashes``."""
    async with open_channel(index) as channel:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
        seen = None
        for _ in range(300):
            reply = await stub.MatchPrefix(
                kvindex_pb2.MatchPrefixRequest(namespace=namespace, block_hashes=hashes)
            )
            seen = [(o.owner_id, o.kind, o.matched_blocks) for o in reply.owners]
            if (owner, kvindex_pb2.OWNER_KIND_WORKER, len(hashes)) in seen:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the index never showed {owner} holding the prompt; last: {seen}")


@pytest.mark.integration
async def test_kv_aware_through_the_coordinator_lands_where_the_pages_are(
    launch, private_redis: RedisProcess, tmp_path: Path
):
    tag = uuid.uuid4().hex[:8]
    models = tmp_path / "models"
    resolve_model("tiny:qwen2", models)  # once, before two workers look for it
    try:
        index = launch("omniflow_services.kv_index", "kv-index").wait_ready()
        for node in ("a", "b"):
            launch(
                "omniflow_services.kv_agent",
                f"kva-{node}-{tag}",
                OMNIFLOW_NODE_ID=f"node-{node}",
                OMNIFLOW_KV_INDEX_ADDR=index.address,
                OMNIFLOW_KV_HOST_BYTES=str(16 * 1024 * 1024),
                OMNIFLOW_KV_SSD_PATH=str(tmp_path / f"ssd-{node}.bin"),
                OMNIFLOW_KV_SSD_BYTES=str(4 * 1024 * 1024),
            ).wait_ready()
        workers = {
            node: launch(
                "omniflow_services.worker",
                f"llm-{node}",
                OMNIFLOW_WORKER_ROLE="llm",
                OMNIFLOW_WORKER_MODEL="tiny:qwen2",
                OMNIFLOW_MODELS_DIR=str(models),
                OMNIFLOW_NODE_ID=f"node-{node}",
                OMNIFLOW_WORKER_KV_BYTES=str(16 * 1024 * 1024),
            )
            for node in ("a", "b")
        }
        for w in workers.values():
            w.wait_ready(timeout_s=180)
        router = launch(
            "omniflow_services.router",
            "router",
            OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2",
            OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S="5",  # a busy test machine: no load-only picks
        ).wait_ready()
        coordinator = launch(
            "omniflow_services.coordinator", "coordinator", OMNIFLOW_ROUTER_ADDR=router.address
        ).wait_ready()

        # The hints the coordinator computes equal the hashes the workers compute.
        async with make_registry("redis", url=private_redis.url) as registry:

            async def listing() -> list[WorkerRecord]:
                return [worker_from_instance(i) for i in await registry.list(WORKER_SERVICE)]

            found = await listing()
            assert {w.worker_id for w in found} == {"llm-a", "llm-b"}
            hinter = KVHinter(listing)
            hints = {p: await hinter.hints("llm", p) for p in (PROMPT_P, PROMPT_Q)}
        namespace = found[0].kv_namespace
        # Node a's worker holds P's pages, node b's Q's.
        for node, prompt in (("a", PROMPT_P), ("b", PROMPT_Q)):
            made = await _generate_on(workers[node].address, prompt)
            assert made == list(hints[prompt].block_hashes) and len(made) >= 4
            await _wait_held(index.address, namespace, made, f"llm-{node}")

        wf = Workflow("kv_route")
        prompt = wf.input("prompt", VType.TEXT)
        gen = wf.call(
            "gen", "llm", "generate", prompt=prompt, params={"max_tokens": 1}, strategy="kv_aware"
        )
        wf.output("cached", gen["cached_tokens"])
        async with Client(coordinator.address) as client:
            await client.register(wf)
            # An order that neither alternation nor always-the-same-worker would follow.
            for node in "aabbba":
                text = PROMPT_P if node == "a" else PROMPT_Q
                result = await client.run("kv_route", {"prompt": text})
                assert result.ok, result.error
                where = [
                    e.node_started.worker_id for e in result.events if e.HasField("node_started")
                ]
                assert where == [f"llm-{node}"], (text[:20], where)
                # The worker reused the whole prefix (every full page of the prompt).
                assert result.outputs["cached"] >= 16 * len(hints[text].block_hashes) - 16
    finally:
        _remove_shm(tag)


def _remove_shm(tag: str) -> None:
    """The agents' host-tier files (they remove them on SIGTERM; this covers a crash)."""
    for path in SHM.glob(f"omniflow-*{tag}*"):
        path.unlink(missing_ok=True)
