"""The SGLang backend without SGLang: page keys, page byte order, stream decoding, sampling
mapping, and the HiCache storage class against real kv-index and kv-agent processes.

What needs SGLang itself (an ``sglang.Engine`` on a GPU) is in ``tests/gpu/``.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omniflow.config import load_settings
from omniflow.errors import FailedPrecondition, InvalidArgument
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.pages import PageAssembler, page_chunks
from omniflow.localredis import start_redis
from omniflow.testing.launch import ServiceProc, start_service, stop_all
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.core import WorkerCore
from omniflow_services.worker.engine import SamplingParams
from omniflow_services.worker.sglang.backend import (
    SGLangConfig,
    StreamDecoder,
    close_key_tables,
    drop_key_table_files,
    expected_layout,
    open_key_tables,
    rank_layouts,
    sampling_to_sglang,
)
from omniflow_services.worker.sglang.hicache import (
    BackendConfig,
    OmniflowHiCacheStorage,
    extra_config,
)
from omniflow_services.worker.sglang.pages import (
    HOST_LAYOUTS,
    HostPageFormat,
    KeyMapper,
    KeyTable,
    PageNames,
    batched,
    host_format_of,
    key_table_path,
    leading_run,
    namespace_model_id,
    sglang_page_keys,
)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
NS = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=8).namespace

# --- keys ----------------------------------------------------------------------------------


def test_page_keys_are_sglangs_sha256_chain() -> None:
    tokens = list(range(100, 140))  # 2 full pages of 16 and a tail of 8
    keys = sglang_page_keys(tokens, 16)
    first = hashlib.sha256(struct.pack("<16I", *tokens[:16])).digest()
    second = hashlib.sha256(first + struct.pack("<16I", *tokens[16:32])).digest()
    assert keys == [first.hex(), second.hex()]
    # A chain continues from a prior key exactly as from the start.
    assert sglang_page_keys(tokens[16:32], 16, prior=keys[0]) == [keys[1]]
    assert sglang_page_keys(tokens[:15], 16) == []


def test_key_mapper_is_deterministic_and_namespaced() -> None:
    keys = sglang_page_keys(list(range(64)), 16)
    a, b = KeyMapper(NS), KeyMapper(NS)
    other = KeyMapper(KVLayout("other", 2, 2, 8).namespace)
    hashes = a.block_hashes(keys)
    assert hashes == b.block_hashes(keys)
    assert all(len(h) == 16 for h in hashes) and len(set(hashes)) == 4
    assert set(hashes).isdisjoint(other.block_hashes(keys))
    # Never a built-in engine block hash of the same tokens.
    assert set(hashes).isdisjoint(block_hashes(NS, list(range(64)), 16))
    assert a.prompt_hashes(list(range(70)), 16) == hashes
    with pytest.raises(InvalidArgument, match="16 bytes"):
        KeyMapper(b"short")
    with pytest.raises(InvalidArgument, match="empty"):
        a.block_hash("")


def test_namespace_model_id_per_rank() -> None:
    assert namespace_model_id("qwen", 0, 1) == "qwen"
    assert namespace_model_id("qwen", 1, 2) == "qwen@tp1of2"


def test_batched_and_leading_run() -> None:
    assert [list(b) for b in batched([1, 2, 3, 4, 5], 2)] == [[1, 2], [3, 4], [5]]
    assert leading_run([True, True, False, True]) == 2
    assert leading_run([True, True]) == 2 and leading_run([]) == 0
    with pytest.raises(InvalidArgument):
        list(batched([1], 0))


# --- page byte order -----------------------------------------------------------------------

L, H, T, D = 3, 2, 4, 5  # distinct sizes: a wrong axis cannot line up by accident


def _code(kv: int, layer: int, head: int, token: int, dim: int) -> int:
    return kv * 10000 + layer * 1000 + head * 100 + token * 10 + dim


def _host_page(layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A flat page in SGLang's ``layout`` whose every element encodes its coordinates."""
    fmt = HostPageFormat(layout, L, H, T, D, "float32")
    idx = dict(zip(HOST_LAYOUTS[layout], range(1, 5), strict=True))
    page = torch.empty(fmt.host_shape, dtype=torch.float32)
    for pos in np.ndindex(*fmt.host_shape):
        coord = {a: pos[i] for a, i in idx.items()}
        page[pos] = _code(pos[0], coord["layer"], coord["head"], coord["token"], coord["dim"])
    return page.reshape(-1).to(dtype)


@pytest.mark.parametrize("layout", sorted(HOST_LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_pages_convert_to_the_contract_order_and_back(layout: str, dtype: str) -> None:
    fmt = HostPageFormat(layout, L, H, T, D, dtype)
    tdtype = fmt.torch_dtype
    host = _host_page(layout, tdtype)
    ours = fmt.to_contract(host)
    assert ours.dtype == torch.uint8 and ours.numel() == fmt.page_bytes
    kv = fmt.kv_layout("m")
    assert kv.page_bytes == fmt.page_bytes
    arr = ours.view(tdtype).to(torch.float32).reshape(kv.page_shape)
    for c, lay, h, t, d in [(0, 0, 0, 0, 0), (1, 2, 1, 3, 4), (0, 1, 1, 2, 3), (1, 0, 1, 3, 0)]:
        # bfloat16 rounds the codes; compare through the same rounding.
        want = torch.tensor(float(_code(c, lay, h, t, d))).to(tdtype).to(torch.float32)
        assert arr[c, lay, h, t, d] == want
    back = fmt.from_contract(ours.numpy().tobytes())
    assert back.dtype == tdtype and torch.equal(back, host)
    assert torch.equal(fmt.from_contract(ours.numpy()), host)


def test_a_page_moves_between_layouts_through_the_contract_order() -> None:
    a = HostPageFormat("page_first", L, H, T, D, "bfloat16")
    b = HostPageFormat("page_head", L, H, T, D, "bfloat16")
    ours = a.to_contract(_host_page("page_first", torch.bfloat16))
    assert torch.equal(b.from_contract(ours), _host_page("page_head", torch.bfloat16))


def test_page_format_rejects_what_it_cannot_carry() -> None:
    with pytest.raises(InvalidArgument, match="layout 'sideways'"):
        HostPageFormat("sideways", L, H, T, D, "float32")
    with pytest.raises(InvalidArgument, match="dtype"):
        HostPageFormat("layer_first", L, H, T, D, "int8")
    fmt = HostPageFormat("layer_first", L, H, T, D, "float32")
    with pytest.raises(InvalidArgument, match="bytes"):
        fmt.to_contract(torch.zeros(7))


@dataclass
class LayerFirstHostPool:
    """Stand-in for SGLang's ``MHATokenToKVPoolHost`` (SGLang cannot run here): the fields
    and the three page methods the storage backend uses, with the layer_first semantics of
    ``get_data_page``/``set_from_flat_data_page`` as read from SGLang."""

    layer_num: int
    head_num: int
    head_dim: int
    page_size: int
    size: int
    dtype: torch.dtype = torch.bfloat16
    layout: str = "layer_first"
    kv_buffer: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.kv_buffer = torch.zeros(2, self.layer_num, self.size, self.head_num, self.head_dim)
        self.kv_buffer = self.kv_buffer.to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(shape)


def test_host_format_of_reads_the_pool() -> None:
    pool = LayerFirstHostPool(layer_num=L, head_num=H, head_dim=D, page_size=T, size=4 * T)
    assert host_format_of(pool) == HostPageFormat("layer_first", L, H, T, D, "bfloat16")
    with pytest.raises(InvalidArgument, match="MHA host pools"):
        host_format_of(object())


# --- streaming and sampling ----------------------------------------------------------------


def _meta(done: int, finish: str | None = None) -> dict[str, Any]:
    reason = {"type": finish} if finish else None
    return {
        "id": "sg-1",
        "prompt_tokens": 40,
        "cached_tokens": 32,
        "completion_tokens": done,
        "finish_reason": reason,
    }


CUMULATIVE = [
    {"text": "He", "output_ids": [5], "meta_info": _meta(1)},
    {"text": "Hello", "output_ids": [5, 6, 7], "meta_info": _meta(3)},
    {"text": "Hello!", "output_ids": [5, 6, 7, 8], "meta_info": _meta(4, "length")},
]
INCREMENTAL = [
    {"text": "He", "output_ids": [5], "meta_info": _meta(1)},
    {"text": "llo", "output_ids": [6, 7], "meta_info": _meta(3)},
    {"text": "!", "output_ids": [8], "meta_info": _meta(4, "length")},
]


@pytest.mark.parametrize("items", [CUMULATIVE, INCREMENTAL], ids=["cumulative", "incremental"])
def test_stream_decoder_yields_deltas_in_either_streaming_mode(items: list[dict]) -> None:
    dec = StreamDecoder("r1")
    outs = [dec.feed(it) for it in items]
    assert [o.new_token_ids for o in outs] == [(5,), (6, 7), (8,)]
    assert "".join(o.text_delta for o in outs) == "Hello!"
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "length" and outs[0].finish_reason is None
    u = outs[-1].usage
    assert (u.prompt_tokens, u.cached_tokens, u.generated_tokens) == (40, 32, 4)
    assert dec.sglang_id == "sg-1" and all(o.request_id == "r1" for o in outs)


def test_stream_decoder_maps_finish_reasons() -> None:
    for kind, want in [("stop", "stop"), ("abort", "abort"), ("length", "length")]:
        out = StreamDecoder("r").feed({"text": "", "output_ids": [], "meta_info": _meta(0, kind)})
        assert out.finished and out.finish_reason == want


def test_sampling_params_map_to_sglang_names() -> None:
    p = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_k=0,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=7,
        stop_token_ids=(2,),
        stop=("\n\n",),
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        min_tokens=2,
        logit_bias=((5, -3.0),),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    assert sampling_to_sglang(p) == {
        "max_new_tokens": 9,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_k": -1,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,  # dropped before the one contract
        "frequency_penalty": -0.25,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "logit_bias": {"5": -3.0},
        "sampling_seed": 7,
    }
    plain = sampling_to_sglang(SamplingParams(max_tokens=3, top_k=20))
    assert plain["top_k"] == 20 and "sampling_seed" not in plain and "stop" not in plain


def test_engine_kwargs_plug_the_storage_backend_in() -> None:
    cfg = SGLangConfig(agent_address="127.0.0.1:1", index_address="127.0.0.1:2")
    kw = cfg.engine_kwargs(Path("/models/q"), "q")
    assert kw["enable_hierarchical_cache"] and kw["hicache_storage_backend"] == "dynamic"
    extra = json.loads(kw["hicache_storage_backend_extra_config"])
    assert extra == extra_config("127.0.0.1:1", "127.0.0.1:2", "q")
    assert extra["module_path"] == "omniflow_services.worker.sglang.hicache"
    assert "enable_hierarchical_cache" not in SGLangConfig().engine_kwargs(Path("/m"), "m")


def _tiny_qwen2() -> Any:
    from omniflow_services.worker.llm.model_folder import ModelConfig

    return ModelConfig.from_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
        }
    )


def test_expected_layout_matches_the_backends_namespace() -> None:
    layout = expected_layout(_tiny_qwen2(), SGLangConfig(dtype="bfloat16"), "tiny")
    pool = LayerFirstHostPool(layer_num=3, head_num=2, head_dim=16, page_size=16, size=64)
    assert host_format_of(pool).kv_layout("tiny") == layout


def test_the_worker_writes_one_table_per_ranks_namespace() -> None:
    layouts = rank_layouts(_tiny_qwen2(), SGLangConfig(dtype="bfloat16", tp_size=2), "tiny")
    assert [ly.model_id for ly in layouts] == [namespace_model_id("tiny", r, 2) for r in (0, 1)]
    assert all(ly.num_kv_heads == 1 for ly in layouts)
    tables = open_key_tables(layouts)
    folder = tables[0].path.parent
    try:
        for ly, t in zip(layouts, tables, strict=True):
            assert t.path == key_table_path(folder, ly.namespace) and t.namespace == ly.namespace
        kw = SGLangConfig(agent_address="127.0.0.1:1", key_tables=str(folder)).engine_kwargs(
            Path("/m"), "m"
        )
        assert json.loads(kw["hicache_storage_backend_extra_config"])["key_tables"] == str(folder)
        # Once SGLang's backend has mapped its table the worker removes the files; what
        # the worker writes after still reaches the backend.
        reader = KeyTable(tables[1].path)
        drop_key_table_files(tables)
        assert not folder.exists()
        PageNames(tables[1], 16).extend(list(range(16)))
        key = bytes.fromhex(sglang_page_keys(list(range(16)), 16)[0])
        assert reader.get(key) == block_hashes(layouts[1].namespace, list(range(16)), 16)[0]
        reader.close()
    finally:
        close_key_tables(tables)
    assert not folder.exists()


# --- selecting the engine without SGLang ---------------------------------------------------


@pytest.mark.skipif(HAS_SGLANG, reason="SGLang is installed: the missing-extra error cannot show")
def test_worker_core_names_the_extra_when_sglang_is_missing(tmp_path: Path) -> None:
    env = {"OMNIFLOW_WORKER_ENGINE": "sglang", "OMNIFLOW_MODELS_DIR": str(tmp_path)}
    core = WorkerCore(load_settings(WorkerSettings, env=env))
    with pytest.raises(FailedPrecondition, match=r"pip install 'omniflow\[sglang\]'"):
        asyncio.run(core.load("tiny:qwen2"))
    assert core.llm is None


def test_backend_config_needs_the_agent() -> None:
    with pytest.raises(InvalidArgument, match="agent_address"):
        BackendConfig.from_extra({})
    with pytest.raises(InvalidArgument, match="> 0"):
        BackendConfig.from_extra({"agent_address": "x:1", "timeout_s": 0})


# --- the PutPages / GetPages framing -------------------------------------------------------


def test_page_chunks_reassemble_and_a_bad_checksum_ends_the_run() -> None:
    hashes = [bytes([i]) * 16 for i in range(3)]
    pages = [bytes([i]) * 1000 for i in range(3)]
    chunks = list(page_chunks(NS, hashes, pages, 300))
    assert len(chunks) == 12 and chunks[0].namespace == NS.hex() and not chunks[1].namespace
    asm = PageAssembler(hashes, 1000)
    for c in chunks:
        asm.feed(c)
    assert [bytes(p) for p in asm.pages] == pages
    chunks[5].data = b"x" * len(chunks[5].data)  # page 1 corrupted in flight
    asm = PageAssembler(hashes, 1000)
    for c in chunks:
        asm.feed(c)
    assert len(asm.pages) == 1 and asm.checksum_failures == 1


# --- against real kv-index and kv-agent processes -------------------------------------------


@dataclass
class DataPlane:
    index: str
    agent: str


@pytest.fixture(scope="module")
def data_plane(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[DataPlane]:
    """A real kv-index and kv-agent (separate processes) on a Redis of their own."""
    tmp = tmp_path_factory.mktemp("sglang-dp")
    redis = start_redis(dir=tmp / "redis", binary=redis_binary)
    tag = uuid.uuid4().hex[:8]
    procs: list[ServiceProc] = []
    try:
        p = start_service("omniflow_services.kv_index", f"kvi-{tag}", tmp=tmp, redis_url=redis.url)
        procs.append(p)
        index = p.wait_ready(60).address
        p = start_service(
            "omniflow_services.kv_agent",
            f"kva-{tag}",
            tmp=tmp,
            redis_url=redis.url,
            OMNIFLOW_KV_INDEX_ADDR=index,
            OMNIFLOW_KV_HOST_BYTES="8388608",
        )
        procs.append(p)
        yield DataPlane(index, p.wait_ready(60).address)
    finally:
        stop_all(procs, timeout_s=15)
        redis.stop()


@dataclass
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` the backend reads."""

    extra_config: dict[str, Any]
    tp_rank: int = 0
    tp_size: int = 1
    is_mla_model: bool = False
    model_name: str = "/models/tiny-sglang"


def _backend(dp: DataPlane, layout: str, **extra: Any) -> OmniflowHiCacheStorage:
    cfg = extra_config(dp.agent, dp.index, "tiny-sglang") | extra
    backend = OmniflowHiCacheStorage(StorageConfig(cfg), {})
    backend.open(HostPageFormat(layout, L, H, T, D, "bfloat16"))
    return backend


def _pages(n: int, seed: int, layout: str = "layer_first") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fmt = HostPageFormat(layout, L, H, T, D, "bfloat16")
    return [torch.randn(fmt.numel, generator=g).to(torch.bfloat16) for _ in range(n)]


@pytest.mark.parametrize("zero_copy", [True, False], ids=["arena", "streamed"])
def test_pages_round_trip_through_the_agent(data_plane: DataPlane, zero_copy: bool) -> None:
    backend = _backend(data_plane, "layer_first", zero_copy=zero_copy)
    try:
        start = 1000 + 5000 * int(zero_copy)  # distinct pages per case
        keys = sglang_page_keys(list(range(start, start + 4 * T)), T)
        pages = _pages(4, seed=int(zero_copy))
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set(keys[:3], pages[:3])
        assert backend.batch_exists(keys) == 3
        assert backend.exists(keys[0]) and not backend.exists(keys[3])
        targets = [torch.zeros_like(p) for p in pages]
        got = backend.batch_get(keys, targets)
        assert got[3] is None
        for i in range(3):
            assert got[i] is targets[i] and torch.equal(targets[i], pages[i])
        stats = backend.omniflow_stats()
        path = "zero_copy" if zero_copy else "streamed"
        assert stats[f"{path}_puts"] == 3 and stats[f"{path}_gets"] == 3
        assert stats["checksum_failures"] == 0
        # Storing again is not an error: the agent holds them already.
        assert backend.batch_set(keys[:3], pages[:3])
    finally:
        backend.close()


def test_a_worker_with_another_host_layout_reads_the_same_pages(data_plane: DataPlane) -> None:
    writer = _backend(data_plane, "page_first")
    reader = _backend(data_plane, "page_head")
    try:
        assert writer.store is not None and reader.store is not None
        assert writer.store.namespace == reader.store.namespace  # layout-independent namespace
        keys = sglang_page_keys(list(range(2000, 2000 + 2 * T)), T)
        pages = _pages(2, seed=5, layout="page_first")
        assert writer.batch_set(keys, pages)
        got = reader.batch_get(keys)
        to = HostPageFormat("page_head", L, H, T, D, "bfloat16")
        fr = HostPageFormat("page_first", L, H, T, D, "bfloat16")
        for g, p in zip(got, pages, strict=True):
            assert g is not None and torch.equal(g, to.from_contract(fr.to_contract(p)))
    finally:
        writer.close()
        reader.close()


def test_v1_interface_reads_and_writes_the_host_pool(data_plane: DataPlane) -> None:
    src = LayerFirstHostPool(layer_num=L, head_num=H, head_dim=D, page_size=T, size=8 * T)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape).to(torch.bfloat16))
    dst = LayerFirstHostPool(layer_num=L, head_num=H, head_dim=D, page_size=T, size=8 * T)
    cfg = extra_config(data_plane.agent, data_plane.index, "tiny-sglang")
    a = OmniflowHiCacheStorage(StorageConfig(cfg), {})
    b = OmniflowHiCacheStorage(StorageConfig(cfg), {})
    a.register_mem_pool_host(src)
    b.register_mem_pool_host(dst)
    try:
        keys = sglang_page_keys(list(range(3000, 3000 + 2 * T)), T)
        src_idx = torch.arange(2 * T, 4 * T)  # pages 2 and 3 of the source pool
        assert a.batch_set_v1(keys, src_idx) == [True, True]
        dst_idx = torch.arange(5 * T, 7 * T)  # land in pages 5 and 6 of the other pool
        flags = b.batch_get_v1([*keys, "missing"], torch.arange(5 * T, 8 * T))
        assert flags == [True, True, False]
        assert torch.equal(dst.kv_buffer[:, :, dst_idx], src.kv_buffer[:, :, src_idx])
        assert not dst.kv_buffer[:, :, 7 * T :].any()
    finally:
        a.close()
        b.close()


def test_faults_are_misses_not_exceptions(data_plane: DataPlane) -> None:
    dead = extra_config("127.0.0.1:1", "", "tiny-sglang", timeout_s=0.5)
    backend = OmniflowHiCacheStorage(StorageConfig(dead), {})
    with pytest.raises(Exception):  # noqa: B017 - register fails loudly at start-up
        backend.open(HostPageFormat("layer_first", L, H, T, D, "bfloat16"))
    # Before a pool is registered every call is a miss, never an exception in SGLang's thread.
    assert backend.batch_exists(["k"]) == 0
    assert backend.batch_get(["k"]) == [None]
    assert not backend.batch_set(["k"], [torch.zeros(4)])
    ok = _backend(data_plane, "layer_first")
    try:
        # A page of the wrong size is refused, and reported as not stored.
        assert not ok.batch_set(["bad-size"], [torch.zeros(7, dtype=torch.bfloat16)])
    finally:
        ok.close()


@pytest.mark.skipif(not HAS_SGLANG, reason="needs SGLang (pip install 'omniflow[sglang]')")
def test_the_class_is_a_hicache_storage_when_sglang_is_installed() -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    assert issubclass(OmniflowHiCacheStorage, HiCacheStorage)


def test_pages_stored_by_sglang_keys_carry_the_chains_names(data_plane: DataPlane) -> None:
    """With the worker's key table, a page SGLang stores under its key lies in the agent
    under the block hash the built-in engine and the gateway give the same tokens."""
    tokens = list(range(7000, 7000 + 3 * T))
    probe = _backend(data_plane, "layer_first")  # no table: the key-derived names
    assert probe.store is not None
    layout = probe.store.layout
    tables = open_key_tables([layout])
    PageNames(tables[0], T).extend(tokens)
    folder = str(tables[0].path.parent)
    writer = _backend(data_plane, "page_first", key_tables=folder)
    reader = _backend(data_plane, "page_head", key_tables=folder)
    try:
        keys = sglang_page_keys(tokens, T)
        assert writer.batch_set(keys, _pages(3, seed=9, layout="page_first"))
        chain = block_hashes(layout.namespace, tokens, T)
        assert probe.store.exists(chain) == 3  # named by the chain, found by it
        assert probe.batch_exists(keys) == 0  # not under the key-derived names
        assert reader.batch_exists(keys) == 3 and all(p is not None for p in reader.batch_get(keys))
    finally:
        for b in (writer, reader, probe):
            b.close()
        close_key_tables(tables)
