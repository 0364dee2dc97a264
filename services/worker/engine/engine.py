"""The engine: requests in, streamed tokens out, KV in a paged pool with prefix reuse.

Thread model: ``add_request`` and ``abort`` may be called from any thread (they only queue
work); ``step`` runs on one thread at a time. ``generate`` is the asyncio wrapper that runs
steps in a worker thread and streams each request's outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import torch

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout, extend_chain
from omniflow_services.worker.engine.config import EngineConfig
from omniflow_services.worker.engine.decode_kv import DecodeKV
from omniflow_services.worker.engine.detok import Detokenizer
from omniflow_services.worker.engine.grammar import Grammars, apply_grammars, grammar_ended
from omniflow_services.worker.engine.kv_loads import FetchedPages, KVLoads
from omniflow_services.worker.engine.kv_pool import KVPool
from omniflow_services.worker.engine.loader import load_model
from omniflow_services.worker.engine.model import SeqInput, build_batch
from omniflow_services.worker.engine.prefix_cache import PrefixCache
from omniflow_services.worker.engine.sampling import PenaltyState, SamplingParams, sample
from omniflow_services.worker.engine.scheduler import ScheduledSeq, Scheduler, SeqState
from omniflow_services.worker.engine.threads import ThreadTuner
from omniflow_services.worker.llm.connector import BlockEventSink, KVConnector
from omniflow_services.worker.llm.types import (
    EmbedSpan,
    EngineLoad,
    EngineStats,
    GenerateRequest,
    RequestOutput,
    Usage,
)

log = logging.getLogger(__name__)


class Engine:
    """A paged-KV engine for one Llama/Qwen2-family model loaded from a Hugging Face folder.

    ``connector`` serves pages missing from the device pool and receives full pages
    (write-through); ``events`` receives device-pool block events. Both are optional.
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        connector: KVConnector | None = None,
        events: BlockEventSink | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        prepack = None if cfg.matmul == "auto" else cfg.matmul == "onednn"
        loaded = load_model(model_dir, cfg.dtype, cfg.device, prepack, cfg.kernels)
        self.model_config = mc = loaded.config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.generation.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.max_model_len = min(
            cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.layout = KVLayout(
            model_id=cfg.model_id or Path(model_dir).resolve().name,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=cfg.dtype,
            page_size=cfg.page_size,
        )
        self._namespace = self.layout.namespace
        num_pages = cfg.num_pages or KVPool.pages_for_bytes(self.layout, cfg.kv_cache_bytes)
        self.pool = KVPool(self.layout, num_pages, cfg.device)
        self.cache = PrefixCache(num_pages, enabled=cfg.enable_prefix_cache)
        self.scheduler = Scheduler(self.cache, cfg, self._match_prefix)
        self.connector = connector
        self.events = events
        # Prefixes from the data plane load off the step thread (see kv_loads).
        self._loads = KVLoads(connector, self.layout) if connector is not None else None
        self.stats = EngineStats()
        self._device = torch.device(cfg.device)
        self._seqs: dict[str, SeqState] = {}
        self._incoming: deque[SeqState] = deque()
        self._aborts: deque[str] = deque()
        self._id_lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._uids = itertools.count()
        if cfg.decode_kv_bytes > 0 and not self.model.fused:
            self.model.decode_kv = DecodeKV(
                mc.num_layers,
                mc.num_kv_heads,
                mc.head_dim,
                cfg.page_size,
                self.model.dtype,
                self._device,
                cfg.decode_kv_bytes,
            )
        # CPU: fewer intra-op threads while another process shares the cores (threads.py).
        adapt = cfg.adapt_threads and self._device.type == "cpu"
        self.threads = ThreadTuner(torch.get_num_threads() if adapt else 1)
        self._loop_task: asyncio.Task[None] | None = None
        log.info(
            "engine ready: %s, %d KV pages of %d tokens",
            self.layout.model_id,
            num_pages,
            cfg.page_size,
        )

    # ---------------------------------------------------------------- requests

    def _validate(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the request's params with ``max_tokens`` decided (unset: up to
        the context, or to what the pool holds when that is less)."""
        if not req.request_id:
            raise InvalidArgument("request_id must not be empty")
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif req.prompt is not None:
            if self.tokenizer is None:
                raise InvalidArgument("this model has no tokenizer: send prompt_token_ids")
            ids = self.tokenizer.encode(req.prompt).ids
        else:
            ids = []
        if not ids:
            raise InvalidArgument("the prompt is empty: send at least 1 token")
        vocab = self.model_config.vocab_size
        covered = self._check_embeds(req.embeds, len(ids))
        bad = [i for i, t in enumerate(ids) if not 0 <= t < vocab and i not in covered]
        if bad:
            raise InvalidArgument(
                f"token id {ids[bad[0]]} (position {bad[0]}) is outside the vocabulary "
                f"[0, {vocab}) and no media embeddings are given for that position"
            )
        req.params.validate(vocab)
        params = req.params.resolved(len(ids), self.max_model_len)
        assert params.max_tokens is not None
        # Unset: nor past what the pool holds, when that is less than the context (a prompt
        # the pool cannot hold, or an explicit max_tokens it cannot, meets the check below).
        cap = self.pool.num_pages * self.layout.page_size - len(ids)
        if req.params.max_tokens is None and 0 < cap < params.max_tokens:
            params = replace(params, max_tokens=cap)
        total = len(ids) + params.max_tokens
        pages = -(-total // self.layout.page_size)
        if pages > self.pool.num_pages:
            raise InvalidArgument(
                f"the request needs up to {pages} KV pages; this worker's pool has "
                f"{self.pool.num_pages}"
            )
        return ids, params

    def _check_embeds(self, spans: tuple[EmbedSpan, ...], n: int) -> set[int]:
        """Positions the spans cover; spans must lie inside the prompt and not overlap."""
        covered: set[int] = set()
        hidden = self.model_config.hidden_size
        for k, sp in enumerate(sorted(spans, key=lambda x: x.start)):
            if sp.length <= 0 or sp.start < 0 or sp.start + sp.length > n:
                raise InvalidArgument(
                    f"embeddings span {k} [{sp.start}, {sp.start + sp.length}) is empty or "
                    f"outside the {n}-token prompt"
                )
            if sp.start in covered:
                raise InvalidArgument(f"embeddings span {k} overlaps the previous span")
            if isinstance(sp.embeds, torch.Tensor) and tuple(sp.embeds.shape) != (
                sp.length,
                hidden,
            ):
                raise InvalidArgument(
                    f"embeddings span {k} has shape {tuple(sp.embeds.shape)}; the span needs "
                    f"({sp.length}, {hidden}) (placeholder tokens x the model's hidden size)"
                )
            covered.update(range(sp.start, sp.start + sp.length))
        return covered

    def add_request(self, req: GenerateRequest) -> None:
        """Validate and queue a request; raises ``InvalidArgument`` naming the limit broken."""
        ids, p = self._validate(req)
        gen = None
        if not p.greedy and p.seed is not None:  # unseeded requests share the global source
            gen = torch.Generator(device=self._device)
            gen.manual_seed(p.seed)
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq = SeqState(
            request_id=req.request_id,
            tokens=ids,
            prompt_len=len(ids),
            params=p,
            stop_ids=frozenset(stop_ids),
            extra_keys=dict(req.extra_keys or {}),
            want_logits=req.return_logits,
            generator=gen,
            embeds=tuple(sorted(req.embeds, key=lambda x: x.start)),
            want_kv=req.return_kv,
            uid=next(self._uids),
            grammar=self.grammars.matcher(p.structured) if p.structured else None,
        )
        if p.penalised:
            seq.penalty = PenaltyState(p, ids, self.model_config.vocab_size, self._device)
        if self.tokenizer is not None:
            seq.detok = Detokenizer(self.tokenizer, p, ids)  # primed with the prompt
        with self._id_lock:
            if req.request_id in self._seqs:
                raise InvalidArgument(f"request_id {req.request_id!r} is already running")
            self._seqs[req.request_id] = seq
        self._incoming.append(seq)

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request (its pages are freed in the next step)."""
        with self._id_lock:
            known = request_id in self._seqs
        if known:
            self._aborts.append(request_id)
        return known

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting)
            + len(self._incoming)
            + (len(self._loads) if self._loads is not None else 0),
            free_pages=self.cache.num_free,
            total_pages=self.pool.num_pages,
        )

    # ------------------------------------------------------------ prefix reuse

    def _extend_hashes(self, seq: SeqState) -> None:
        extend_chain(seq.hashes, self._namespace, seq.tokens, self.layout.page_size, seq.extra_keys)

    def _prefix_limit(self, seq: SeqState) -> int:
        self._extend_hashes(seq)
        # At least one token must be computed to produce the next token's logits.
        return min(len(seq.hashes), (len(seq.tokens) - 1) // self.layout.page_size)

    def _loader(self) -> KVLoads | None:
        """The loader of the current connector (one assigned after construction included)."""
        c = self.connector
        if c is None:
            return None
        loads = self._loads
        if loads is None or (loads.connector is not c and not len(loads)):
            loads = self._loads = KVLoads(c, self.layout)
        return loads

    def _start_load(self, seq: SeqState) -> bool:
        """Start fetching the pages beyond the device pool's prefix; True if one started."""
        loads = self._loader()
        if loads is None or not self.cache.enabled:
            return False
        limit = self._prefix_limit(seq)
        have = 0
        while have < limit and self.cache.page_of(seq.hashes[have]) is not None:
            have += 1
        if have >= limit:
            return False
        loads.start(seq, seq.hashes[have:limit], have)
        self.stats.async_loads += 1
        return True

    def _deliver(self, seq: object, fetched: FetchedPages) -> None:
        """A fetch finished: the request joins the queue (unless it was aborted meanwhile)."""
        assert isinstance(seq, SeqState)
        if fetched.failed:
            self.stats.connector_failures += 1
        with self._id_lock:
            alive = self._seqs.get(seq.request_id) is seq
        if not alive:
            return
        seq.fetched = fetched if fetched.blobs else None
        self.scheduler.add(seq)

    def _match_prefix(self, seq: SeqState) -> None:
        """Reuse device pages, then the pages fetched for it, for the longest known prefix."""
        ps = self.layout.page_size
        limit = self._prefix_limit(seq)
        pages = self.cache.match(seq.hashes[:limit])
        device_hits = len(pages)
        got, seq.fetched = seq.fetched, None
        # Fetched pages count only if they continue the device prefix (it may have changed).
        if got is not None and got.start <= len(pages) < limit:
            usable = got.blobs[len(pages) - got.start : limit - got.start]
            if usable:
                pages += self._import_fetched(seq.hashes[len(pages) :], usable)
        seq.pages = pages
        seq.num_computed = len(pages) * ps
        seq.registered = len(pages)
        if not seq.matched_once:  # count a request once, not again after a preemption
            seq.matched_once = True
            seq.num_cached = seq.num_computed
            self.stats.prompt_tokens += seq.prompt_len
            self.stats.device_hit_tokens += device_hits * ps
            self.stats.connector_hit_tokens += (len(pages) - device_hits) * ps

    def _import_fetched(self, hashes: list[bytes], blobs: list[bytes]) -> list[int]:
        """Copy fetched pages into newly allocated pool pages and register their hashes."""
        pages = self.cache.allocate(len(blobs))
        if pages is None:
            return []
        self.pool.import_pages(pages, blobs)
        for page, h in zip(pages, hashes, strict=False):
            self.cache.register(page, h)
        return pages

    def _register_full_pages(self, seq: SeqState, written: list[tuple[bytes, int]]) -> None:
        full = seq.num_computed // self.layout.page_size
        if full > seq.registered:
            self._extend_hashes(seq)
            for i in range(seq.registered, full):
                if self.cache.register(seq.pages[i], seq.hashes[i]):
                    written.append((seq.hashes[i], seq.pages[i]))
            seq.registered = full

    def _write_through(self, written: list[tuple[bytes, int]]) -> None:
        if self.connector is None or not written:
            return
        try:
            blobs = self.pool.export_pages([p for _, p in written])
            self.connector.store_pages(self.layout, [h for h, _ in written], blobs)
            self.stats.pages_written_through += len(written)
        except Exception as exc:
            self.stats.connector_failures += 1
            log.warning("KV connector store failed (pages stay local): %s", exc)

    def _publish_events(self) -> None:
        ev = self.cache.drain_events()
        if self.events is None or not (ev.stored or ev.removed):
            return
        try:
            self.events.publish(self.layout, ev.stored, ev.removed)
        except Exception as exc:
            self.stats.event_failures += 1
            log.warning("publishing block events failed: %s", exc)

    # -------------------------------------------------------------------- step

    def _drain(self, outputs: list[RequestOutput]) -> None:
        while self._incoming:
            seq = self._incoming.popleft()
            if not self._start_load(seq):
                self.scheduler.add(seq)
        if self._loads is not None:
            self._loads.collect(self._deliver)
        while self._aborts:
            rid = self._aborts.popleft()
            seq = self._seqs.get(rid)
            if seq is not None:
                outputs.append(self._finish(seq, "abort", (), ""))

    def _finish(self, seq: SeqState, reason: str, new: tuple[int, ...], text: str) -> RequestOutput:
        self.scheduler.remove(seq)
        with self._id_lock:
            self._seqs.pop(seq.request_id, None)
        return self._output(seq, new, text, reason, None)

    def _chunk_embeds(
        self, seq: SeqState, start: int, n: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Rows (within the chunk) and embeddings of the media positions in [start, start+n)."""
        rows: list[int] = []
        values: list[torch.Tensor] = []
        for sp in seq.embeds:
            lo, hi = max(start, sp.start), min(start + n, sp.start + sp.length)
            if lo >= hi:
                continue
            emb = sp.embeds if isinstance(sp.embeds, torch.Tensor) else sp.embeds()
            if tuple(emb.shape) != (sp.length, self.model_config.hidden_size):
                raise InvalidArgument(
                    f"embeddings at position {sp.start} have shape {tuple(emb.shape)}; "
                    f"want ({sp.length}, {self.model_config.hidden_size})"
                )
            rows.extend(range(lo - start, hi - start))
            values.append(emb[lo - sp.start : hi - sp.start])
        return rows, values

    def _output(
        self,
        seq: SeqState,
        new: tuple[int, ...],
        text: str,
        reason: str | None,
        logits: torch.Tensor | None,
    ) -> RequestOutput:
        usage = Usage(seq.prompt_len, seq.num_cached, seq.num_output)
        return RequestOutput(seq.request_id, new, text, reason is not None, reason, usage, logits)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and forward; return the outputs it produced."""
        outputs: list[RequestOutput] = []
        self._drain(outputs)
        scheduled = self.scheduler.schedule()
        if not scheduled and self._loads is not None and len(self._loads):
            # Only prefix loads are pending: wait for one rather than spin the step loop.
            self._loads.wait(0.05)
            self._loads.collect(self._deliver)
            scheduled = self.scheduler.schedule()
        if scheduled:
            tokens, started = self.stats.batched_tokens, time.perf_counter()
            self._run(scheduled, outputs)
            if self.threads.active:
                n = self.threads.record(
                    time.perf_counter() - started, self.stats.batched_tokens - tokens
                )
                if n != torch.get_num_threads():
                    torch.set_num_threads(n)
        self._publish_events()
        self.stats.preemptions = self.scheduler.num_preemptions
        return outputs

    def _run(self, scheduled: list[ScheduledSeq], outputs: list[RequestOutput]) -> None:
        ps = self.layout.page_size
        inputs = []
        kept = []
        for s in scheduled:
            nc = s.seq.num_computed
            inp = SeqInput(
                s.seq.tokens[nc : nc + s.num_tokens], nc, s.seq.pages, s.completes, uid=s.seq.uid
            )
            if s.seq.embeds:
                try:
                    rows, values = self._chunk_embeds(s.seq, nc, s.num_tokens)
                except Exception as exc:  # this request's media failed: drop it, not the step
                    log.warning("request %s: media embeddings failed: %s", s.seq.request_id, exc)
                    out = self._finish(s.seq, "abort", (), "")
                    outputs.append(_with_logits(out, None, error=exc))
                    continue
                if rows:
                    inp.embed_rows = rows
                    inp.embed_values = torch.cat(values).to(self._device, self.model.dtype)
            inputs.append(inp)
            kept.append(s)
        scheduled = kept
        if not scheduled:
            return
        batch = build_batch(inputs, ps, self._device)
        logits = self.model.forward(batch, self.pool)
        self.stats.steps += 1
        self.stats.batched_tokens += int(batch.input_ids.numel())
        done = [s.seq for s in scheduled if s.completes]
        written: list[tuple[bytes, int]] = []
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
            self._register_full_pages(s.seq, written)
        self._write_through(written)
        if not done:
            return
        kvs = {id(q): self._gather_kv(q) for q in done if q.want_kv and q.num_output == 0}
        apply_grammars(logits, [q.grammar for q in done])  # requests with a grammar only
        sampled = sample(
            logits,
            [q.params for q in done],
            [q.penalty for q in done],
            [q.generator for q in done],
            # Before min_tokens no stop id may be drawn (vLLM's MinTokensLogitsProcessor).
            [q.stop_ids if q.num_output < q.params.min_tokens else None for q in done],
        )
        for row, (seq, tok) in enumerate(zip(done, sampled.tokens, strict=True)):
            seq.tokens.append(tok)
            if seq.penalty is not None:
                seq.penalty.add(tok)
            self.stats.generated_tokens += 1
            reason = None
            # A stop id's own text is left out unless include_stop_str_in_output (vLLM).
            by_id = tok in seq.stop_ids
            feed = seq.detok is not None and (not by_id or seq.params.include_stop_str_in_output)
            stopped_by_text = seq.detok.add(tok) if feed else False
            if by_id or stopped_by_text or grammar_ended(seq.grammar, tok):
                reason = "stop"
            elif seq.num_output >= seq.params.max_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
            text = seq.detok.delta(final=reason is not None) if seq.detok is not None else ""
            row_logits = logits[row : row + 1].cpu() if seq.want_logits else None
            kv = kvs.get(id(seq))
            if reason is None:
                out = self._output(seq, (tok,), text, None, row_logits)
            else:
                out = self._finish(seq, reason, (tok,), text)
            if row_logits is not None or kv is not None:
                out = _with_logits(out, row_logits, kv=kv)
            lp = sampled.logprobs[row]
            if lp is not None:
                top = sampled.top_logprobs[row]
                out = replace(out, logprobs=(lp,), top_logprobs=(top,) if top else None)
            outputs.append(out)

    def _gather_kv(self, seq: SeqState) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's K and V from the seq's pages, each [layers, kv_heads, len, dim]."""
        n = seq.prompt_len
        ps = self.layout.page_size
        idx = torch.tensor(seq.pages[: -(-n // ps)], dtype=torch.long, device=self._device)
        data = self.pool.data.index_select(3, idx)  # [2, L, H, pages, P, D]
        two, layers, heads, pages, page, dim = data.shape
        kv = data.reshape(two, layers, heads, pages * page, dim)[:, :, :, :n].clone()
        return kv[0], kv[1]

    # ------------------------------------------------------------------- async

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream ``req``'s outputs; closing the iterator early aborts the request."""
        self.add_request(req)  # raises on bad input, before any stream exists
        # No step output can arrive before this line: outputs are dispatched on this loop.
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[req.request_id] = queue
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True  # the engine already dropped the request
                    raise out
                finished = out.finished
                if out.error is not None:
                    raise out.error
                yield out
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self.abort(req.request_id)

    def _fail_all(self, exc: Exception) -> None:
        """Drop every request (pages released) and hand ``exc`` to their streams."""
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort", (), "")
            q = self._streams.get(seq.request_id)
            if q is not None:
                q.put_nowait(exc)
        self._incoming.clear()

    async def _run_loop(self) -> None:
        while self.has_unfinished():
            try:
                outputs = await asyncio.to_thread(self.step)
            except Exception as exc:  # a bug or a device fault: fail every stream, keep serving
                log.exception("engine step failed; failing %d requests", len(self._seqs))
                self._fail_all(exc)
                continue
            for out in outputs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)


def _with_logits(
    out: RequestOutput,
    logits: torch.Tensor | None,
    *,
    kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    error: BaseException | None = None,
) -> RequestOutput:
    return replace(out, logits=logits, kv=kv, error=error)
