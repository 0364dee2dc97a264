"""``prefill_only`` keeps its promise: its final reply comes only once the prompt's full
pages are stored in the node's kv-agent, so a diffusion worker sent the returned
``prompt_pages`` at once (no polling) pulls every one of them instead of recomputing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from mm_cluster import Cluster, make_models, start_cluster

from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.kv.client import KVClient
from omniflow.rpc.client import open_channel

PAGE = 16  # the tiny backbone's page size (the llm worker's default engine config)
WORDS = ("castle", "river", "forest", "harbor", "desert", "glacier", "meadow", "volcano")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[Cluster]:
    pytest.importorskip("PIL", reason="image encoding needs Pillow (the worker extra)")
    models = tmp_path_factory.mktemp("prefill-models")
    make_models(models)
    root = tmp_path_factory.mktemp("prefill-cluster")
    yield from start_cluster(root, models, ("llm", "diffusion"))


def _stub(
    cluster: Cluster, role: str
) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]:
    ch = open_channel(cluster.addresses[role], default_timeout_s=60)
    return ch, worker_pb2_grpc.WorkerServiceStub(ch)


def _prompt(i: int) -> str:
    # Different for every i from its first words, long enough for many full pages.
    head = f"picture {i}: a {WORDS[i % len(WORDS)]} number {i * 7919}"
    return head + ", " + " ".join(f"{WORDS[(i + k) % len(WORDS)]} {i}-{k}" for k in range(35))


async def test_prefill_only_replies_once_its_pages_are_stored(cluster: Cluster) -> None:
    lch, llm = _stub(cluster, "llm")
    dch, dif = _stub(cluster, "diffusion")
    async with lch, dch, KVClient(cluster.addresses["kv-agent"]) as agent:
        ns = (await llm.GetInfo(worker_pb2.GetInfoRequest())).info.kv_namespace
        got: list[tuple[int, int]] = []
        held: list[int] = []
        for i in range(20):
            req = worker_pb2.GenerateRequest(
                messages=worker_pb2.ChatMessages(
                    messages=[
                        worker_pb2.ChatMessage(
                            role="user", content=[worker_pb2.ContentPart(text=_prompt(i))]
                        )
                    ],
                    add_generation_prompt=True,
                ),
                prefill_only=True,
            )
            pre = [o async for o in llm.Generate(req)][-1]
            ids = list(pre.prompt_token_ids.ids)
            assert len(pre.prompt_block_hashes) == len(ids) // PAGE >= 8
            # At once: the reply itself is the promise that the pages can be pulled. The agent
            # holds every one of them (one look, no polling) ...
            pages = await agent.locate(bytes.fromhex(ns), pre.prompt_block_hashes)
            held.append(len(pre.prompt_block_hashes) - len(pages))
            await pages.release()
            # ... and the diffusion worker pulls them.
            image = await dif.GenerateImage(
                worker_pb2.GenerateImageRequest(
                    prompt_pages=worker_pb2.PromptPages(
                        token_ids=pre.prompt_token_ids,
                        kv_namespace=ns,
                        block_hashes=pre.prompt_block_hashes,
                    ),
                    width=32,
                    height=32,
                    steps=1,
                    seed=i,
                )
            )
            assert image.prompt_tokens == len(ids)
            # Every full page pulled; the one holding the last token (if full) is computed.
            got.append((image.cached_prompt_tokens, (len(ids) - 1) // PAGE * PAGE))
        missing = [n for n in held if n]
        assert not missing, (
            f"{len(missing)} of 20 replies came before their pages (pages missing): {missing}"
        )
        short = [(c // PAGE, w // PAGE) for c, w in got if c != w]
        assert not short, f"{len(short)} of 20 runs pulled fewer pages (pulled, full): {short}"
    assert "prefill_only replies before its pages" not in cluster.log("llm")
