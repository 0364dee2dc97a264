"""The embed role: inputs (texts or token ids) → pooled sentence vectors, batched.

Requests queue for one model; a batcher thread takes what is waiting (up to
``max_seqs`` inputs and ``BATCH_TOKENS`` padded tokens), sorts it by length so that short
inputs are not padded to long ones, and runs each slice through the encoder in one
forward. Texts are tokenized here with the model's ``tokenizer.json`` (its [CLS]/[SEP]
included, as sentence-transformers does); token ids are taken as given. No KV pages, no
routing by prompt hashes: tokenizing at the worker costs the gateway nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from omniflow.errors import InvalidArgument
from omniflow_services.worker.embed import metrics
from omniflow_services.worker.embed.bert import BertEncoder

log = logging.getLogger(__name__)

#: Padded tokens in one forward (inputs x longest input of the slice).
BATCH_TOKENS = 16384
#: Inputs in one request (OpenAI's limit on an embeddings ``input`` array).
MAX_INPUTS = 2048


@dataclass(frozen=True, slots=True)
class Embedded:
    """One request's vectors [n, dim] (float32) and the tokens it read."""

    vectors: torch.Tensor
    prompt_tokens: int


@dataclass(slots=True)
class _Job:
    ids: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[torch.Tensor]
    rows: list[torch.Tensor | None] = field(default_factory=list)
    left: int = 0


class EmbedRole:
    """A sentence-embedding model and its batcher."""

    def __init__(self, folder: Path, device: str = "cpu", max_seqs: int = 64) -> None:
        from tokenizers import Tokenizer

        self.folder = folder
        self.model = BertEncoder(folder, device)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise InvalidArgument(f"no tokenizer.json in {folder}: texts cannot be embedded")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.max_seqs = max_seqs
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="embed-batcher", daemon=True)
        self._thread.start()

    @classmethod
    async def load(cls, folder: Path, device: str, max_seqs: int) -> EmbedRole:
        role = await asyncio.to_thread(cls, folder, device, max_seqs)
        await role.embed_texts(["warm up"])  # the first forward pays the allocations
        return role

    @property
    def dim(self) -> int:
        return self.model.dim

    def check_dimensions(self, dims: int) -> None:
        """InvalidArgument unless the model serves vectors of ``dims`` (vLLM's rules)."""
        name = self.folder.name
        if not self.model.matryoshka:
            raise InvalidArgument(
                f"Model {name!r} does not support Matryoshka embeddings; dimensions must be "
                f"unset (received dimensions={dims})."
            )
        if not 1 <= dims <= self.dim:
            raise InvalidArgument(
                f"Model {name!r} only supports dimensions in range [1, {self.dim}], got {dims}."
            )
        allowed = self.model.matryoshka_dimensions
        if allowed and dims not in allowed:
            raise InvalidArgument(
                f"Model {name!r} only supports Matryoshka dimensions {list(allowed)}, got {dims}."
            )

    def shorten(self, vectors: torch.Tensor, dims: int) -> torch.Tensor:
        """The first ``dims`` components, normalised again when the model normalises."""
        cut = vectors[:, :dims]
        return F.normalize(cut, p=2, dim=1) if self.model.pooling.normalize else cut

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # ------------------------------------------------------------ requests

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def check(self, ids: list[list[int]], where: str = "input") -> None:
        """InvalidArgument naming the first input that is empty, too long or out of vocab."""
        if not ids:
            raise InvalidArgument(f"{where} is empty: send at least one string or token list")
        if len(ids) > MAX_INPUTS:
            raise InvalidArgument(f"{where} has {len(ids)} entries; at most {MAX_INPUTS}")
        vocab, most = self.model.vocab_size, self.model.max_len
        for i, x in enumerate(ids):
            if not x:
                raise InvalidArgument(f"{where}[{i}] is empty")
            if len(x) > most:
                raise InvalidArgument(
                    f"{where}[{i}] is {len(x)} tokens; this model's maximum context length is "
                    f"{most} tokens. Please reduce the length of the input."
                )
            if min(x) < 0 or max(x) >= vocab:
                raise InvalidArgument(
                    f"{where}[{i}] holds a token id outside the vocabulary [0, {vocab})"
                )

    async def embed_texts(self, texts: Sequence[str]) -> Embedded:
        if not texts:
            raise InvalidArgument("input is empty: send at least one string or token list")
        if len(texts) > MAX_INPUTS:
            raise InvalidArgument(f"input has {len(texts)} entries; at most {MAX_INPUTS}")
        ids = await asyncio.to_thread(self.tokenize, texts)
        return await self.embed_ids(ids)

    async def embed_ids(self, ids: list[list[int]]) -> Embedded:
        self.check(ids)
        loop = asyncio.get_running_loop()
        job = _Job(ids, loop, loop.create_future(), [None] * len(ids), len(ids))
        with self._cv:
            self._queue.append(job)
            self._cv.notify()
        vectors = await job.future
        return Embedded(vectors, sum(len(x) for x in ids))

    # ------------------------------------------------------------ the batcher thread

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                jobs, self._queue = self._queue, []
            # (job, row) of every input waiting, shortest first: slices pad little.
            todo = sorted(
                ((j, r) for j in jobs if not j.future.done() for r in range(len(j.ids))),
                key=lambda jr: len(jr[0].ids[jr[1]]),
            )
            start = 0
            while start < len(todo):
                end = start + 1
                while (
                    end < len(todo)
                    and end - start < self.max_seqs
                    and (end + 1 - start) * len(todo[end][0].ids[todo[end][1]]) <= BATCH_TOKENS
                ):
                    end += 1
                part = todo[start:end]
                start = end
                try:
                    began = time.perf_counter()
                    out = self.model.embed([j.ids[r] for j, r in part])
                    metrics.FORWARD.observe(time.perf_counter() - began)
                    metrics.BATCH.observe(len(part))
                    metrics.EMBEDDED.inc(len(part))
                    metrics.TOKENS.inc(sum(len(j.ids[r]) for j, r in part))
                except Exception as exc:  # a failed forward fails its requests, not the thread
                    log.exception("embedding forward failed")
                    for j in {id(j): j for j, _ in part}.values():
                        j.loop.call_soon_threadsafe(_fail, j.future, exc)
                    continue
                for k, (j, r) in enumerate(part):
                    j.rows[r] = out[k]
                    j.left -= 1
                    if j.left == 0:
                        result = torch.stack([x for x in j.rows if x is not None])
                        j.loop.call_soon_threadsafe(_resolve, j.future, result)


def _resolve(future: asyncio.Future[torch.Tensor], value: torch.Tensor) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[torch.Tensor], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
