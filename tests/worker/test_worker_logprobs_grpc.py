"""Logprobs and penalties through the worker's gRPC API (in-process, port 0), checked
against transformers, and the capability the worker advertises for them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from inprocess import host_settings

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.models.resolve import resolve_model
from omniflow.rpc.client import open_channel
from omniflow.rpc.server import ServiceHost
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.server import WorkerApp

transformers = pytest.importorskip("transformers", reason="the reference model is transformers'")


@pytest.fixture
async def worker(private_redis, tmp_path: Path) -> AsyncIterator[tuple[ServiceHost, Path]]:
    models = tmp_path / "models"
    settings = host_settings(
        WorkerSettings,
        private_redis.url,
        instance_id="llm-lp",
        role="llm",
        model="tiny:llama",
        models_dir=str(models),
        kv_cache_bytes=4 * 1024 * 1024,
    )
    host = ServiceHost(WorkerApp(settings), settings)
    await host.start()
    try:
        yield host, resolve_model("tiny:llama", models)
    finally:
        await host.stop()


async def test_logprobs_over_grpc_equal_transformers(worker) -> None:  # type: ignore[no-untyped-def]
    host, folder = worker
    prompt = list(range(5, 25))
    sampling = common_pb2.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    async with open_channel(host.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        info = (await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)).info
        assert {"generate", "logprobs", "penalties"} <= set(info.operations)
        req = worker_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling
        )
        chunks = [c async for c in stub.Generate(req, timeout=30)]
        bad = worker_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=2, presence_penalty=3.0),
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(bad, timeout=30):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "presence_penalty must be in [-2, 2]" in err.value.details()
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    tops = [t for c in chunks for t in c.top_logprobs]
    assert len(tokens) == len(logprobs) == len(tops) == 6
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits.float(), -1)
    assert tokens == ref.argmax(-1).tolist()
    torch.testing.assert_close(
        torch.tensor(logprobs), ref[torch.arange(6), torch.tensor(tokens)], atol=1e-4, rtol=0
    )
    for pos, top in enumerate(tops):
        assert list(top.token_ids) == torch.topk(ref[pos], 3).indices.tolist()
        torch.testing.assert_close(
            torch.tensor(list(top.logprobs)), torch.topk(ref[pos], 3).values, atol=1e-4, rtol=0
        )


async def test_return_logprobs_and_the_kv_layout_in_get_info(worker) -> None:  # type: ignore[no-untyped-def]
    """The deprecated ``return_logprobs`` still asks for logprobs (as ``sampling.logprobs``);
    GetInfo carries the engine's KV layout, the same one LoadModel reports."""
    host, _ = worker
    prompt = list(range(5, 25))
    async with open_channel(host.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        reply = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        plain = worker_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        asked = worker_pb2.GenerateRequest()
        asked.CopyFrom(plain)
        asked.return_logprobs = True
        without = [c async for c in stub.Generate(plain, timeout=30)]
        with_lp = [c async for c in stub.Generate(asked, timeout=30)]
    engine = host.app.core.llm.engine
    layout = reply.kv_layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size) == (
        engine.layout.num_layers,
        engine.layout.num_kv_heads,
        engine.layout.head_dim,
        engine.layout.page_size,
    )
    assert layout.dtype == engine.layout.dtype and layout.model_id == engine.layout.model_id
    assert reply.info.kv_namespace == engine.layout.namespace_hex
    assert [lp for c in without for lp in c.logprobs] == []
    tokens = [t for c in with_lp for t in c.token_ids]
    logprobs = [lp for c in with_lp for lp in c.logprobs]
    assert tokens == [t for c in without for t in c.token_ids]
    assert len(logprobs) == len(tokens) == 4 and all(lp <= 0.0 for lp in logprobs)
