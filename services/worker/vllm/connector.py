"""``OmniflowConnector``: a vLLM KV connector (``KVConnectorBase_V1``) over the kv-agents.

vLLM loads it from ``kv_transfer_config``::

    {"kv_connector": "OmniflowConnector",
     "kv_connector_module_path": "omniflow_services.worker.vllm.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"agent_address": ..., "index_address": ..., layout ...}}

(``backend.VLLMRole`` writes this). Pages are named by Omni-Flow block hashes (DESIGN.md
§4.1: chained xxh3_128 over namespace + the tokens of each 16-token page), so every vLLM
worker of the same model and KV layout finds the pages any other one stored, on any node.

Scheduler side (vLLM's EngineCore process):

- ``get_num_new_matched_tokens``: the leading pages past vLLM's own prefix-cache hit that
  the node's kv-agent holds or can pull from another node's agent (the index names it),
  rounded down to whole vLLM blocks, and never the prompt's last token;
- ``update_state_after_alloc`` / ``build_connector_meta``: which blocks to fill from which
  pages (loads) and which newly completed full pages to store (saves);
- ``request_finished``: forgets the request (saves copy the pages out at once, so vLLM
  frees its blocks at once).

Worker side (vLLM's worker process): ``start_load_kv`` hands each load to a loader thread,
which fetches the pages (the local agent pulls missing ones from the remote agent first;
every page is checksummed) and writes them into the request's blocks, while vLLM parks the
request (``WAITING_FOR_REMOTE_KVS``) and the rest of the batch keeps stepping;
``get_finished`` reports it done. A page that cannot be had fails its block, which
``get_block_ids_with_load_errors`` reports, and vLLM recomputes from there
(``kv_load_failure_policy=recompute``). A request that ends while its load runs keeps its
blocks until the loader is done with them (``request_finished`` → True, released through
``get_finished``). ``"load_async": false`` loads inside the step instead, before the
forward pass. ``wait_for_save`` copies completed pages out of the blocks and a writer
thread stores them at the agent (zero-copy into its arena on the same node), off the step.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from omniflow.config import CommonSettings, load_settings
from omniflow.errors import InvalidArgument
from omniflow.kv.blocking import AgentPageStore
from omniflow.kv.blocks import extend_chain
from omniflow.logsetup import setup_logging
from omniflow_services.worker.vllm.connector_config import (
    CLASS_NAME,
    MODULE_PATH,
    ConnectorConfig,
    transfer_config,
)
from omniflow_services.worker.vllm.pages import BlockFormat

__all__ = [
    "CLASS_NAME",
    "MODULE_PATH",
    "ConnectorConfig",
    "OmniflowConnector",
    "transfer_config",
]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
RETRY_S = 5.0
# A finished lookup answers vLLM's asks for the same request for this long after its first
# answer (vLLM asks again when it could not allocate the request's blocks in that step).
LOOKUP_FRESH_S = 2.0
LOOKUP_THREADS = 4
# How long the first ask waits for its lookup (the scheduler's thread blocked off the GIL):
# answered at once, vLLM schedules the request in this step. Skipped, an idle engine
# re-asks every millisecond from a busy loop that starves the lookup thread of the GIL;
# behind the gateway that turned a few-ms lookup into seconds of TTFT (issue 19).
LOOKUP_WAIT_S = 0.02


# --- scheduler → worker metadata ----------------------------------------------------------


@dataclass(slots=True)
class LoadJob:
    """Fill ``block_ids`` (whole vLLM blocks) with the pages ``hashes``, in order."""

    request_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass(slots=True)
class SaveJob:
    """Store pages: ``(vLLM block id, page index within the block, block hash)`` each."""

    request_id: str
    pages: list[tuple[int, int, bytes]]


@dataclass
class OmniflowConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Requests that ended while their pages were loading: vLLM frees their blocks once the
    # worker reports them (get_finished's "sending" set), never under a running load.
    held: list[str] = field(default_factory=list)


@dataclass
class OmniflowConnectorStats(KVConnectorStats):
    """Counter increments since the last report, summed over the connector's sides; they
    reach the worker's process in vLLM's scheduler stats (its Prometheus series)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass(slots=True)
class _Lookup:
    """A lookup of one request's pages from page ``first`` on, running off the step."""

    first: int
    future: Future[int]  # how many leading pages of the ask the agents hold
    answered: float = 0.0  # when its result was first handed to vLLM


@dataclass(slots=True)
class _Tracked:
    """What the scheduler side knows of one running request."""

    request: Request
    local_tokens: int = 0  # vLLM's own prefix hit when it was first scheduled
    block_ids: list[int] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)  # block hashes of its full pages so far
    saved: int = 0  # leading pages already in the agent (stored, loaded or cached before)


class OmniflowConnector(KVConnectorBase_V1):
    """Stores full pages to the node's kv-agent and loads missing prefixes from it."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if not logging.getLogger().handlers:  # vLLM's engine processes configure only "vllm"
            level = load_settings(CommonSettings).log_level
            setup_logging(f"vllm-{role.name.lower()}", level)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = ConnectorConfig.from_extra(extra)
        self.layout = self.config.layout
        self.block_size = int(vllm_config.cache_config.block_size)
        self.page_size = self.layout.page_size
        if self.block_size % self.page_size:
            raise InvalidArgument(
                f"vLLM block_size {self.block_size} must be a multiple of the page size "
                f"{self.page_size}"
            )
        self.store = AgentPageStore(
            self.config.agent_address,
            self.layout,
            index_address=self.config.index_address,
            timeout_s=self.config.timeout_s,
        )
        self._registered = False
        self._retry_at = 0.0
        self._reported: dict[str, int] = {}
        self.stats: dict[str, int] = {
            "lookups": 0, "matched_tokens": 0, "loaded_pages": 0, "failed_blocks": 0,
            "saved_pages": 0, "dropped_saves": 0, "errors": 0,
        }  # fmt: skip
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []
        self._loading: dict[str, set[int]] = {}  # async loads not reported done: their blocks
        self._no_retry: set[str] = set()  # a load of theirs failed: recompute, no new lookup
        self._held: list[str] = []
        self._lookups: dict[str, _Lookup] = {}
        self._lookup_pool: ThreadPoolExecutor | None = None
        # worker side
        self._caches: list[torch.Tensor] = []
        self._format: BlockFormat | None = None
        self._failed: set[int] = set()
        self._failed_lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[None]] = {}
        self._to_release: set[str] = set()
        self._saves: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue(
            self.config.max_queued_saves
        )
        self._writer: threading.Thread | None = None
        log.info(
            "omniflow connector (%s): namespace %s at agent %s, vLLM block %d = %d pages",
            role.name,
            self.layout.namespace_hex,
            self.config.agent_address,
            self.block_size,
            self.block_size // self.page_size,
        )

    def _ready(self) -> bool:
        """Register the namespace once (the agent learns its page size from the index);
        after a failure, requests recompute for RETRY_S before the next try, so that an
        unreachable agent never costs the scheduler a timeout per request."""
        if not self._registered and time.monotonic() >= self._retry_at:
            try:
                self.store.register()
                self._registered = True
            except Exception as exc:
                self.stats["errors"] += 1
                self._retry_at = time.monotonic() + RETRY_S
                log.warning("kv-agent/index not reachable (%s): recompute for %.0fs", exc, RETRY_S)
        return self._registered

    # ==== scheduler side =====================================================================

    def _chain(self, request: Request, pages: int) -> list[bytes]:
        t = self._tracked.get(request.request_id)
        chain = t.chain if t is not None else []
        ns, size = self.layout.namespace, self.page_size
        extend_chain(chain, ns, request.all_token_ids, size, pages=pages)
        return chain[:pages]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t = self._tracked.get(request.request_id)
        if t is None:
            t = self._tracked[request.request_id] = _Tracked(request)
        t.local_tokens = num_computed_tokens
        if not self.config.load or request.request_id in self._no_retry:
            return 0, False
        prompt = request.prompt_token_ids or []
        # vLLM must compute at least the last prompt token; loads are whole blocks.
        limit = (len(prompt) - 1) // self.block_size * self.block_size
        if limit <= num_computed_tokens:
            return 0, False
        first = num_computed_tokens // self.page_size
        have = self._looked_up(request, first, limit // self.page_size)
        if have is None:  # vLLM skips the request this step and asks again on the next
            return None, False
        reach = (num_computed_tokens + have * self.page_size) // self.block_size * self.block_size
        extra = max(0, reach - num_computed_tokens)
        if extra:
            self.stats["matched_tokens"] += extra
        return extra, bool(extra) and self.config.load_async

    def _looked_up(self, request: Request, first: int, pages: int) -> int | None:
        """Leading pages from ``first`` (up to ``pages``) that this node's agent holds or
        can pull; None while the lookup runs. The lookup (``LocatePages`` at the agent,
        ``MatchPrefix`` at the index) runs on a thread, so that the scheduler's step never
        waits on the network for long: the first ask starts it and waits at most
        ``LOOKUP_WAIT_S`` for it, a later one reads its answer."""
        rid = request.request_id
        lk = self._lookups.get(rid)
        if lk is not None and lk.first <= first:
            if not lk.future.done():
                return None
            now = time.monotonic()
            lk.answered = lk.answered or now  # however long it ran, its first answer counts
            if now - lk.answered <= LOOKUP_FRESH_S:
                try:
                    held = lk.future.result()
                except Exception as exc:  # the agent is an accelerator: recompute
                    self.stats["errors"] += 1
                    log.warning("kv-agent lookup failed (%s): recompute", exc)
                    del self._lookups[rid]
                    return 0
                return max(0, lk.first + held - first)
        hashes = self._chain(request, pages)[first:]
        if self._lookup_pool is None:
            self._lookup_pool = ThreadPoolExecutor(
                LOOKUP_THREADS, thread_name_prefix="omniflow-kv-lookup"
            )
        future = self._lookup_pool.submit(self._lookup, hashes)
        self._lookups[rid] = _Lookup(first, future)
        self.stats["lookups"] += 1
        try:
            future.result(timeout=LOOKUP_WAIT_S)
        except FuturesTimeout:
            return None  # vLLM asks again on a later step
        except Exception:
            pass  # the answer path below counts it and recomputes
        return self._looked_up(request, first, pages)

    def _lookup(self, hashes: list[bytes]) -> int:
        # The namespace registration also happens here, off the step.
        return self.store.exists(hashes) if self._ready() else 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self._lookups.pop(rid, None)  # answered; a preempted request asks anew
        t = self._tracked.get(rid)
        if t is None:
            t = self._tracked[rid] = _Tracked(request)
        t.request = request
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        # The external tokens follow vLLM's own block-aligned hit, which is what the
        # scheduler told get_num_new_matched_tokens right before allocating.
        first = t.local_tokens // self.block_size
        count = -(-num_external_tokens // self.block_size)
        per = self.block_size // self.page_size
        chain = self._chain(request, (first + count) * per)
        self._loads.append(LoadJob(rid, block_ids[first : first + count], chain[first * per :]))
        if self.config.load_async:
            self._loading[rid] = set(block_ids[first : first + count])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OmniflowConnectorMetadata(loads=self._loads, held=self._held)
        self._loads, self._held = [], []
        if not self.config.save:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            t.saved = new.num_computed_tokens // self.page_size  # cached: stored before
            self._save(t, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                t.block_ids.extend(new_ids[0])
            self._save(t, cached.num_computed_tokens[i] + scheduled.get(rid, 0), meta)
        return meta

    def _save(self, t: _Tracked, computed: int, meta: OmniflowConnectorMetadata) -> None:
        """Queue the pages that are full once this step has run."""
        tokens = t.request.all_token_ids
        full = min(computed, len(tokens)) // self.page_size
        full = min(full, len(t.block_ids) * (self.block_size // self.page_size))
        if full <= t.saved:
            return
        chain = self._chain(t.request, full)
        per = self.block_size // self.page_size
        pages = [(t.block_ids[i // per], i % per, chain[i]) for i in range(t.saved, full)]
        t.saved = full
        meta.saves.append(SaveJob(t.request.request_id, pages))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # A failed load goes back to vLLM's queue with nothing loaded: it must not ask the
        # agents again (the index may name the failed source until its lease lapses).
        invalid = connector_output.invalid_block_ids or set()
        if invalid:
            self._no_retry.update(r for r, blocks in self._loading.items() if blocks & invalid)
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._no_retry.discard(rid)
        self._lookups.pop(rid, None)  # a running lookup ends on its own; nobody reads it
        if rid in self._loading:  # a load still writes into its blocks: free them later
            del self._loading[rid]
            self._held.append(rid)
            return True, None
        return False, None  # pages were copied out in wait_for_save: free the blocks now

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def index(name: str) -> int:
            m = _LAYER_INDEX.search(name)
            return int(m.group(1)) if m else 0

        names = sorted(kv_caches, key=index)
        caches = [kv_caches[n] for n in names]
        lay = self.layout
        fmt = BlockFormat(
            self.config.kv_format, lay.num_layers, lay.num_kv_heads, lay.head_dim,
            self.block_size, self.page_size, caches[0].dtype,
        )  # fmt: skip
        try:
            fmt.check(caches)
        except InvalidArgument as exc:  # serve without the cache tier rather than corrupt KV
            log.error("omniflow connector disabled: %s", exc)
            return
        if fmt.page_bytes != lay.page_bytes:
            log.error(
                "omniflow connector disabled: %d-byte pages from vLLM, %d in the namespace",
                fmt.page_bytes,
                lay.page_bytes,
            )
            return
        self._caches, self._format = caches, fmt
        log.info(
            "omniflow connector: %d layers, %s format, cache %s %s",
            len(names),
            fmt.format,
            tuple(caches[0].shape),
            caches[0].dtype,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OmniflowConnectorMetadata)
        for rid in meta.held:
            self._to_release.add(rid)
        for job in meta.loads:
            if not self.config.load_async:
                self._load(job)
                continue
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="omniflow-kv-load")
            self._pending[job.request_id] = self._loader.submit(self._load, job)

    def _load(self, job: LoadJob) -> None:
        fmt = self._format
        per = self.block_size // self.page_size
        pages: list[np.ndarray] = []
        if fmt is not None and self._ready():
            try:
                pages = self.store.get(job.hashes)
            except Exception as exc:  # recomputed by vLLM (get_block_ids_with_load_errors)
                self.stats["errors"] += 1
                log.warning(
                    "loading %d pages for %s failed: %s", len(job.hashes), job.request_id, exc
                )
        whole = min(len(pages) // per, len(job.block_ids))
        if whole and fmt is not None:
            data = torch.from_numpy(np.stack(pages[: whole * per]))
            fmt.inject(self._caches, job.block_ids[:whole], data)
            self.stats["loaded_pages"] += whole * per
        failed = job.block_ids[whole:]
        if failed:
            self.stats["failed_blocks"] += len(failed)
            with self._failed_lock:  # before the load counts as done (get_finished)
                self._failed.update(failed)
            log.info(
                "request %s: %d of %d blocks loaded from the kv-agent; vLLM recomputes the rest",
                job.request_id,
                whole,
                len(job.block_ids),
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # pages hold every layer: copied out once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, OmniflowConnectorMetadata)
        fmt = self._format
        if fmt is None or not meta.saves:
            return
        items = [p for job in meta.saves for p in job.pages]
        blocks = sorted({b for b, _, _ in items})
        where = {b: i for i, b in enumerate(blocks)}
        # One copy out of vLLM's blocks, here in the step; the send runs in the writer.
        data = fmt.extract(self._caches, blocks)
        rows = torch.tensor([where[b] * fmt.pages_per_block + j for b, j, _ in items])
        self._enqueue([h for _, _, h in items], data.index_select(0, rows))

    def _enqueue(self, hashes: list[bytes], pages: torch.Tensor) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="omniflow-kv-save")
            self._writer.daemon = True
            self._writer.start()
        try:
            self._saves.put_nowait((hashes, pages))
        except queue.Full:  # a lost save is a future miss, never a stall of the step
            self.stats["dropped_saves"] += len(hashes)

    def _write_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            hashes, pages = item
            if not self._ready():
                self.stats["dropped_saves"] += len(hashes)
                continue
            try:
                self.stats["saved_pages"] += self.store.put(hashes, list(pages.numpy()))
            except Exception as exc:
                self.stats["errors"] += 1
                log.warning("storing %d pages at the kv-agent failed: %s", len(hashes), exc)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> OmniflowConnectorStats | None:
        return OmniflowConnectorStats(data=dict(data or {}))

    def get_kv_connector_stats(self) -> OmniflowConnectorStats | None:
        now = dict(self.stats)
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return OmniflowConnectorStats(data=delta) if any(delta.values()) else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose held blocks may be freed, requests whose pages are in)."""
        recving: set[str] = set()
        for rid, fut in list(self._pending.items()):
            if fut.done():
                del self._pending[rid]
                if rid not in self._to_release:
                    recving.add(rid)
        released = {rid for rid in self._to_release if rid not in self._pending}
        self._to_release -= released
        return released or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._failed_lock:
            out, self._failed = self._failed, set()
        return out

    def shutdown(self) -> None:
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
        if self._writer is not None:
            self._saves.put(None)
            self._writer.join(timeout=self.config.timeout_s)
        self.store.close()
        log.info("omniflow connector stats: %s", self.stats)
