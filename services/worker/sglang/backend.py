"""The llm role on SGLang: an in-process ``sglang.Engine`` behind the worker API (GPU only).

Selected with ``OMNIFLOW_WORKER_ENGINE=sglang``; SGLang is imported only then (``pip
install 'omniflow[sglang]'``, a CUDA GPU). ``SGLangRole`` has ``LLMRole``'s interface, so
the gRPC edge serves it unchanged: token ids in, streamed token ids and text deltas out,
finish reason and usage (cached tokens from SGLang's ``meta_info``), abort.

SGLang's hierarchical cache is switched on with ``OmniflowHiCacheStorage``
(``sglang.hicache``) as its storage tier, so pages SGLang evicts from GPU and host memory
land in the node's kv-agent and every SGLang worker of the model can load them back.

SGLang API read (sgl-project/sglang main, Nov 2026; sglang 0.5.23 on PyPI):
``python/sglang/srt/entrypoints/engine.py`` (``Engine(**server_args)``,
``async_generate(input_ids=..., sampling_params=..., stream=True)`` yielding dicts with
``text``, ``output_ids`` and ``meta_info`` — ``id``, ``finish_reason`` ``{"type": ...}``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``), ``server_args.py``
(``page_size``, ``tp_size``, ``mem_fraction_static``, ``enable_hierarchical_cache``,
``hicache_write_policy``, ``hicache_storage_backend``,
``hicache_storage_backend_extra_config``), ``sampling/sampling_params.py`` (names below) and
``managers/tokenizer_manager.py`` (``abort_request(rid)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import inspect
import json
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.errors import FailedPrecondition, Unimplemented
from omniflow.finish import engine_finish
from omniflow.kv.blocks import KVLayout
from omniflow.sampling import SamplingParams
from omniflow.security.kvsalt import salted_extra_keys
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.llm.backends import BackendRole
from omniflow_services.worker.llm.connector import find_data_plane
from omniflow_services.worker.llm.model_folder import ModelConfig, folder_tokenizer
from omniflow_services.worker.llm.types import EngineLoad, RequestOutput, Usage
from omniflow_services.worker.sglang.hicache import extra_config
from omniflow_services.worker.sglang.pages import (
    HostPageFormat,
    KeyTable,
    PageNames,
    key_table_path,
    namespace_model_id,
)

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'omniflow[sglang]' on a machine with a CUDA GPU"


def sampling_to_sglang(p: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters (resolved: ``max_tokens`` set) as SGLang's ``sampling_params``
    dict (same meanings: SGLang's top_k -1 disables it where ours is 0; its
    ``min_new_tokens`` is our ``min_tokens``; ``no_stop_trim`` keeps the stop string, our
    ``include_stop_str_in_output``; ``logit_bias`` keys are token ids as strings). The seed
    is sent only when set: older SGLang versions do not know ``sampling_seed``."""
    out: dict[str, Any] = {
        "max_new_tokens": p.max_tokens,
        "min_new_tokens": p.min_tokens,
        "temperature": p.temperature,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "ignore_eos": p.ignore_eos,
        "skip_special_tokens": p.skip_special_tokens,
        "no_stop_trim": p.include_stop_str_in_output,
    }
    if p.stop:
        out["stop"] = list(p.stop)
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in p.logit_bias}
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


class StreamDecoder:
    """SGLang stream items → our ``RequestOutput`` deltas.

    SGLang streams cumulative ``text``/``output_ids`` by default and deltas with
    ``incremental_streaming_output``; ``meta_info["completion_tokens"]`` is cumulative in
    both, which tells the new ids apart in either mode.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.count = 0
        self.text = ""
        self.sglang_id = ""
        self.finished = False

    def feed(self, item: dict[str, Any]) -> RequestOutput:
        meta = item.get("meta_info") or {}
        self.sglang_id = str(meta.get("id", self.sglang_id))
        ids = list(item.get("output_ids") or [])
        completion = int(meta.get("completion_tokens", self.count + len(ids)))
        delta = max(0, completion - self.count)
        cumulative = self.count > 0 and len(ids) == completion
        new_ids = ids[len(ids) - delta :] if 0 < delta <= len(ids) else ids if delta else []
        text = str(item.get("text") or "")
        if cumulative or (self.count == 0 and text.startswith(self.text)):
            text_delta = text[len(self.text) :] if text.startswith(self.text) else text
            self.text = text
        else:
            text_delta = text
            self.text += text
        self.count = completion
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        self.finished = kind is not None
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=tuple(int(t) for t in new_ids),
            text_delta=text_delta,
            finished=self.finished,
            finish_reason=engine_finish(kind) if self.finished else None,
            usage=Usage(
                prompt_tokens=int(meta.get("prompt_tokens", 0)),
                cached_tokens=int(meta.get("cached_tokens", 0)),
                generated_tokens=completion,
            ),
        )


@dataclass(frozen=True, slots=True)
class SGLangConfig:
    """How the worker starts SGLang. Empty ``agent_address``: no distributed cache tier."""

    dtype: str = "bfloat16"
    page_size: int = 16
    tp_size: int = 1
    mem_fraction_static: float = 0.6
    agent_address: str = ""
    index_address: str = ""
    model_id: str = ""
    hicache_ratio: float = 2.0
    hicache_mem_layout: str = ""  # empty: SGLang's default
    hicache_write_policy: str = "write_through"
    key_tables: str = ""  # the folder of the KeyTables the worker writes (sglang.pages)
    extra: dict[str, Any] = field(default_factory=dict)  # more ServerArgs fields

    def engine_kwargs(self, model_dir: Path, model_id: str) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model_path": str(model_dir),
            "dtype": self.dtype,
            "page_size": self.page_size,
            "tp_size": self.tp_size,
            "mem_fraction_static": self.mem_fraction_static,
            "log_level": "warning",
        }
        if self.agent_address:
            kw |= {
                "enable_hierarchical_cache": True,
                "hicache_ratio": self.hicache_ratio,
                "hicache_write_policy": self.hicache_write_policy,
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": json.dumps(
                    extra_config(
                        self.agent_address,
                        self.index_address,
                        model_id,
                        key_tables=self.key_tables,
                    )
                ),
            }
            if self.hicache_mem_layout:
                kw["hicache_mem_layout"] = self.hicache_mem_layout
        return kw | self.extra


class SGLangEngine:
    """The parts of our ``Engine`` the worker uses, over an ``sglang.Engine``."""

    def __init__(
        self,
        engine: Any,
        layout: KVLayout,
        tokenizer: Any,
        cfg: ModelConfig,
        tables: list[KeyTable] | None = None,
    ) -> None:
        self.sgl = engine
        self.layout = layout
        self.tokenizer = tokenizer
        self.model_config = cfg
        self.tables = tables or []  # one per rank's namespace; written by this worker
        self.active: dict[str, StreamDecoder] = {}
        self.total_pages = 0
        try:
            info = engine.get_server_info()
            self.total_pages = int(info.get("max_total_num_tokens", 0)) // layout.page_size
        except Exception as exc:  # informative only
            log.info("SGLang server info unavailable: %s", exc)

    def load(self) -> EngineLoad:
        # SGLang's scheduler runs in another process: we know what this worker streams.
        return EngineLoad(len(self.active), 0, 0, self.total_pages)

    def abort(self, request_id: str) -> bool:
        dec = self.active.get(request_id)
        if dec is None:
            return False
        self.sgl.tokenizer_manager.abort_request(dec.sglang_id or request_id)
        return True

    def shutdown(self) -> None:
        self.sgl.shutdown()
        close_key_tables(self.tables)
        self.tables = []


class SGLangRole(BackendRole):
    """``LLMRole`` served by SGLang."""

    engine: SGLangEngine  # type: ignore[assignment]

    def __init__(self, engine: SGLangEngine, model_dir: Path) -> None:
        super().__init__(engine, model_dir)  # type: ignore[arg-type]
        self._pass_rid = "rid" in inspect.signature(engine.sgl.async_generate).parameters

    @classmethod
    async def load(cls, model_dir: Path, config: SGLangConfig) -> SGLangRole:  # type: ignore[override]
        require_sglang()
        import sglang  # optional, GPU-only dependency

        cfg = ModelConfig.from_folder(model_dir)
        # The built-in engine's default model id: the resolved folder's name.
        model_id = config.model_id or (await asyncio.to_thread(Path(model_dir).resolve)).name
        layouts = rank_layouts(cfg, config, model_id)
        tables: list[KeyTable] = []
        if config.agent_address:  # pages named as the other engines name them
            tables = open_key_tables(layouts)
            config = dataclasses.replace(config, key_tables=str(tables[0].path.parent))
        try:
            # In the event loop's thread on purpose: SGLang installs signal handlers, which
            # only the main thread may do. Health stays NOT_SERVING meanwhile.
            engine = sglang.Engine(**config.engine_kwargs(model_dir, model_id))
        except BaseException:
            close_key_tables(tables)
            raise
        finally:
            # SGLang's backend mapped its table while the engine started: the files go now,
            # so none is left behind however the worker ends (the mappings stay valid).
            drop_key_table_files(tables)
        tok = folder_tokenizer(model_dir)
        return cls(SGLangEngine(engine, layouts[0], tok, cfg, tables), model_dir)

    # prompt_hashes: LLMRole's, the chain's block hashes, which the KeyTables give the
    # pages SGLang stores (a salted tenant's request: pages SGLang keeps to itself).

    def page_names(self) -> list[PageNames]:
        """Recorders of this request's page names (none for a salted tenant's request:
        SGLang's keys carry no tenant, so the table must not give them a tenant's name)."""
        if salted_extra_keys(None) is not None:
            return []
        return [PageNames(t, self.engine.layout.page_size) for t in self.engine.tables]

    async def generate(  # type: ignore[override]
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        params = self.check_prompt(ids, params)
        if params.structured is not None:  # refused, never ignored (not mapped to SGLang yet)
            raise Unimplemented(
                f"structured.{params.structured.kind}: the SGLang engine backend does not "
                "apply structured output; serve the model with the built-in or vLLM engine"
            )
        dec = StreamDecoder(request_id)
        names, seq = self.page_names(), list(ids)
        for n in names:  # before SGLang can store or look up any page of the prompt
            n.extend(seq)
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": sampling_to_sglang(params),
            "stream": True,
        }
        if self._pass_rid:
            kwargs["rid"] = request_id
            dec.sglang_id = request_id
        self.engine.active[request_id] = dec
        try:
            stream = await self.engine.sgl.async_generate(**kwargs)
            async for item in stream:
                out = dec.feed(item)
                if names and out.new_token_ids:  # generated pages, before SGLang backs them up
                    seq.extend(out.new_token_ids)
                    for n in names:
                        n.extend(seq)
                yield out
                if dec.finished:
                    break
        finally:
            self.engine.active.pop(request_id, None)
            if not dec.finished and dec.sglang_id:  # the caller went away: free SGLang's KV
                self.engine.sgl.tokenizer_manager.abort_request(dec.sglang_id)


def rank_layouts(cfg: ModelConfig, config: SGLangConfig, model_id: str) -> list[KVLayout]:
    """The namespace layout of each tensor-parallel rank's pages (one on one GPU)."""
    heads = max(1, cfg.num_kv_heads // config.tp_size)
    fmt = HostPageFormat(
        "layer_first", cfg.num_layers, heads, config.page_size, cfg.head_dim, config.dtype
    )
    tp = max(1, config.tp_size)
    return [fmt.kv_layout(namespace_model_id(model_id, r, tp)) for r in range(tp)]


def expected_layout(cfg: ModelConfig, config: SGLangConfig, model_id: str) -> KVLayout:
    """The namespace layout SGLang's pages get (rank 0's when tensor-parallel)."""
    return rank_layouts(cfg, config, model_id)[0]


def open_key_tables(layouts: list[KVLayout]) -> list[KeyTable]:
    """A new folder (in shared memory where there is one) with a ``KeyTable`` per layout."""
    shm = Path("/dev/shm")
    folder = Path(
        tempfile.mkdtemp(prefix="omniflow-sglang-keys-", dir=shm if shm.is_dir() else None)
    )
    return [
        KeyTable(key_table_path(folder, ly.namespace), namespace=ly.namespace) for ly in layouts
    ]


def drop_key_table_files(tables: list[KeyTable]) -> None:
    """Remove the folder ``open_key_tables`` made (open mappings of its files stay valid)."""
    if tables:
        shutil.rmtree(tables[0].path.parent, ignore_errors=True)


def close_key_tables(tables: list[KeyTable]) -> None:
    """Close the tables ``open_key_tables`` made and remove their files."""
    for t in tables:
        t.close()
    drop_key_table_files(tables)


def require_sglang() -> None:
    """FailedPrecondition, saying how to install, unless SGLang and a CUDA GPU are here."""
    if importlib.util.find_spec("sglang") is None:
        raise FailedPrecondition(f"OMNIFLOW_WORKER_ENGINE=sglang needs SGLang: {INSTALL_HINT}")
    import torch

    if not torch.cuda.is_available():
        raise FailedPrecondition(f"OMNIFLOW_WORKER_ENGINE=sglang needs a CUDA GPU: {INSTALL_HINT}")


async def load_sglang_role(folder: Path, settings: WorkerSettings, dtype: str) -> SGLangRole:
    """What ``WorkerCore.load`` calls for ``OMNIFLOW_WORKER_ENGINE=sglang``."""
    require_sglang()
    agent, index = await find_data_plane(settings)
    if not agent:
        log.warning("no kv-agent found: SGLang runs without the distributed cache tier")
    config = SGLangConfig(dtype=dtype, agent_address=agent, index_address=index)
    return await SGLangRole.load(folder, config)
