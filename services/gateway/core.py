"""The gateway's request logic, free of HTTP: which workers serve a model, the prompt's
template and token ids (once, here), the pick of a worker with the prompt's block hashes
(in this process: ``Backends.pick``), and the worker streams of each choice.

Models are named as workers registered them: the last component of a worker's model
folder (``smollm2-135m-instruct``); workflows as ``workflow:<name>``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from omniflow.backoff import Backoff
from omniflow.chat import Preprocessor, acached_preprocessor
from omniflow.errors import InvalidArgument, NotFound, OmniflowError, Unavailable
from omniflow.prompt_size import check_prompt_size, ids_bytes, messages_bytes, text_bytes
from omniflow.sampling import SamplingParams
from omniflow.security import policy
from omniflow.workers import WorkerRecord
from omniflow_services.gateway import metrics
from omniflow_services.gateway.audio import talker_voice
from omniflow_services.gateway.backends import Backends
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.gateway.fairshare import TenantShare
from omniflow_services.gateway.types import (
    GenChunk,
    GenerateCall,
    MediaPart,
    Picked,
    RunChunk,
    WorkflowInfo,
)
from omniflow_services.gateway.workflows import data_url

log = logging.getLogger(__name__)

WORKFLOW_PREFIX = "workflow:"
DEFAULT_PAGE_SIZE = 16
INLINE_CHARS = 1024  # prompts up to this many characters are tokenized on the loop
MAX_ATTEMPTS = 3  # tries of one generation on workers that fail before its end


T = TypeVar("T")
SERVED_ROLES = ("llm", "diffusion", "talker", "embed")


def new_id(prefix: str) -> str:
    """An unguessable id (128 random bits)."""
    return f"{prefix}-{secrets.token_hex(16)}"


def served_name(worker: WorkerRecord) -> str:
    """The model name a worker serves: its registered folder's last component."""
    model = worker.metadata.get("served_model", "") or worker.model
    return Path(model).name if "/" in model else model


def transcribe_name(worker: WorkerRecord) -> str:
    """The model name an encoder's Whisper serves transcriptions as ("" without one)."""
    return Path(worker.metadata.get("transcribe_model", "")).name


def has_capability(worker: WorkerRecord, name: str) -> bool:
    """Whether a worker advertises ``name`` (in its operations or its ``capabilities``)."""
    caps = worker.metadata.get("capabilities", "").split(",")
    return name in worker.operations or name in caps


@dataclass(slots=True)
class Prepared:
    """One prompt, ready for the workers: ids and hashes (text) or messages (media)."""

    model: str
    workers: list[WorkerRecord]
    sampling: SamplingParams
    token_ids: list[int] | None = None
    hashes: list[bytes] = field(default_factory=list)
    namespace: bytes = b""
    messages: list[tuple[str, list[str | MediaPart]]] | None = None
    pre: Preprocessor | None = None
    #: Workers picked ahead for choice indexes (see GatewayCore.prepick).
    picked: dict[int, Picked] = field(default_factory=dict)


@dataclass(slots=True)
class Finished:
    """The accounting of one choice once it ends."""

    finish_reason: str = "stop"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class GatewayCore:
    """Model catalog, preprocessing and the worker calls of every API request."""

    def __init__(self, settings: GatewaySettings, backends: Backends) -> None:
        self.settings = settings
        self.backends = backends
        self._pre: dict[tuple[str, str, str], Preprocessor] = {}
        #: Each tenant's share (the guard's): generated and prompt tokens are counted here.
        self.share: TenantShare | None = None

    # ------------------------------------------------------------ catalog

    async def models(self) -> list[tuple[str, str]]:
        """(model id, owner) of every served model and workflow."""
        seen: dict[str, str] = {}
        for w in await self.backends.workers():
            if w.role in SERVED_ROLES and w.model:
                seen.setdefault(served_name(w), f"omniflow:{w.role}")
            if w.role == "encoder" and w.metadata.get("transcribe_model"):
                seen.setdefault(transcribe_name(w), "omniflow:encoder")
        try:
            for name in await self.backends.workflows():
                seen.setdefault(WORKFLOW_PREFIX + name, "omniflow:workflow")
        except OmniflowError as exc:  # no coordinator: models still list
            log.debug("no workflows listed: %s", exc)
        return sorted(seen.items())

    async def workers_for(self, model: str, role: str) -> list[WorkerRecord]:
        """Live workers of ``role`` serving ``model``: NotFound when none ever served it."""
        everyone = await self.backends.workers()
        mine = [
            w for w in everyone if w.role == role and w.model and model in (served_name(w), w.model)
        ]
        if not mine:
            names = sorted({served_name(w) for w in everyone if w.role == role and w.model})
            raise NotFound(
                f"model {model!r} is not served by any {role} worker; served: "
                f"{', '.join(names) or 'none'} (GET /v1/models lists them)"
            )
        return mine

    async def _exclude(self, role: str, mine: list[WorkerRecord]) -> tuple[str, ...]:
        # The router picks by role: workers of other models are excluded by id.
        ids = {w.worker_id for w in mine}
        everyone = await self.backends.workers()
        return tuple(w.worker_id for w in everyone if w.role == role and w.worker_id not in ids)

    def _folder(self, worker: WorkerRecord) -> Path:
        path = Path(worker.model)
        if (path / "tokenizer.json").is_file():
            return path
        local = Path(self.settings.models_dir).expanduser() / served_name(worker)
        if (local / "tokenizer.json").is_file():
            return local
        raise Unavailable(
            f"the tokenizer of model {served_name(worker)!r} is not readable here (neither "
            f"{path} nor {local} has tokenizer.json): mount the model folder or set "
            "OMNIFLOW_MODELS_DIR"
        )

    async def preprocessor(self, worker: WorkerRecord) -> Preprocessor:
        """The worker model's preprocessor (loaded on a thread the first time only)."""
        key = (worker.model, worker.kv_namespace, worker.metadata.get("page_size", ""))
        pre = self._pre.get(key)
        if pre is None:
            page = int(key[2] or DEFAULT_PAGE_SIZE)
            pre = await acached_preprocessor(self._folder(worker), worker.namespace_id, page)
            self._pre[key] = pre
        return pre

    def check_prompt(self, size: int) -> None:
        """400 for a prompt past ``max_prompt_bytes``, before it is templated or tokenized."""
        check_prompt_size(size, self.settings.max_prompt_bytes, "OMNIFLOW_GATEWAY_MAX_PROMPT_BYTES")

    def check_capabilities(self, workers: list[WorkerRecord], sampling: SamplingParams) -> None:
        """400 for a sampling feature the model's workers do not advertise."""
        needs = []
        if sampling.logprobs:
            needs.append(("logprobs", "logprobs"))
        if sampling.presence_penalty or sampling.frequency_penalty:
            field_name = "presence_penalty" if sampling.presence_penalty else "frequency_penalty"
            needs.append(("penalties", field_name))
        for cap, field_name in needs:
            if not any(has_capability(w, cap) for w in workers):
                raise InvalidArgument(
                    f"{field_name} is not supported by the workers of this model (they do not "
                    f"advertise {cap!r}); leave it unset"
                )

    # ------------------------------------------------------------ preparing prompts

    async def prepare_chat(
        self,
        model: str,
        messages: Sequence[dict[str, Any]],
        sampling: SamplingParams,
        template: dict[str, Any] | None = None,
    ) -> Prepared:
        """Template and tokenize the chat once (text) or keep its media parts (multimodal).

        ``template``: what the template is rendered with besides the messages (tools,
        ``add_generation_prompt``, ... : ``Preprocessor.render_chat``'s options)."""
        self.check_prompt(messages_bytes(messages))  # before anything templates it
        workers = await self.workers_for(model, "llm")
        self.check_capabilities(workers, sampling)
        if any(isinstance(m["content"], list) for m in messages):
            parts = [
                (m["role"], _media_parts(m["content"] or "", i)) for i, m in enumerate(messages)
            ]
            if any(not isinstance(p, str) for _, ps in parts for p in ps):
                return Prepared(model, workers, sampling, messages=parts)
            messages = [
                {**m, "content": "".join(p for p in ps if isinstance(p, str))}
                if isinstance(m["content"], list)
                else m
                for m, (_, ps) in zip(messages, parts, strict=True)
            ]
        pre = await self.preprocessor(workers[0])
        size = sum(len(m["content"] or "") for m in messages)
        ids, hashes = await _off_loop(size, _chat_ids, pre, messages, template or {})
        sampling = _for_prompt(sampling, workers, len(ids), pre)
        return Prepared(model, workers, sampling, ids, hashes, workers[0].namespace_id, pre=pre)

    async def prepare_prompt(
        self, model: str, prompt: str | list[int], sampling: SamplingParams
    ) -> Prepared:
        """A completion prompt: text (tokenized here) or token ids as given."""
        self.check_prompt(text_bytes(prompt) if isinstance(prompt, str) else ids_bytes(prompt))
        workers = await self.workers_for(model, "llm")
        self.check_capabilities(workers, sampling)
        pre = await self.preprocessor(workers[0])
        if isinstance(prompt, str):
            ids, hashes = await _off_loop(len(prompt), _text_ids, pre, prompt)
        else:
            ids, hashes = list(prompt), pre.block_hashes(prompt)
        sampling = _for_prompt(sampling, workers, len(ids), pre)
        return Prepared(model, workers, sampling, ids, hashes, workers[0].namespace_id, pre=pre)

    # ------------------------------------------------------------ generating

    async def generate(
        self, prep: Prepared, index: int, whole: bool = False
    ) -> AsyncIterator[GenChunk]:
        """Choice ``index`` of a prompt: pick a worker, stream its Generate, report.

        With a seed, choice i samples with seed + i so that the choices differ. A worker
        that is unavailable before its first token is replaced by another (up to
        ``MAX_ATTEMPTS`` tries; the same worker again, once restarted, when it is the
        model's only one, waited for with backoff within OMNIFLOW_GATEWAY_FAILOVER_WAIT_S
        once those tries are spent). With ``whole`` (a non-streamed answer) the chunks are held
        until the generation ends, so that a worker dying mid-answer is retried too.
        """
        sampling = prep.sampling
        if sampling.seed is not None and index:
            sampling = replace(sampling, seed=(sampling.seed + index) % 2**63)
        call = GenerateCall(new_id("gen"), sampling, prep.token_ids, prep.messages)
        others = await self._exclude("llm", prep.workers)
        failed: tuple[str, ...] = ()
        ahead = prep.picked.pop(index, None)
        wait = Backoff.within(self.settings.failover_wait_s, 0.05, 1.0)
        for attempt in itertools.count():
            mine = {w.worker_id for w in prep.workers} - set(failed)
            picked = ahead or await self._pick(prep, others + (failed if mine else ()))
            ahead = None
            sent = False
            held: list[GenChunk] = []
            last: GenChunk | None = None
            try:
                async with aclosing(self.backends.generate(picked.address, call)) as stream:
                    async for chunk in stream:
                        if whole:
                            held.append(chunk)
                            continue
                        sent, last = True, chunk
                        yield chunk
            except Unavailable as exc:
                self._report(picked, False, "UNAVAILABLE")
                # Past its tries, a worker restarting (the model's only one) is waited for.
                if sent or (attempt >= MAX_ATTEMPTS - 1 and not await wait.wait()):
                    raise
                metrics.RETRIES.labels("mid_answer" if held else "before_first_token").inc()
                log.info("worker %s unavailable (%s): trying another", picked.worker_id, exc)
                failed = (*failed, picked.worker_id)
                call = replace(call, request_id=new_id("gen"))
                continue
            except OmniflowError as exc:
                self._report(picked, False, exc.code_name)
                raise
            except BaseException:  # cancelled: the client went away, not the worker's fault
                self._report(picked, True)
                raise
            self._report(picked, True)
            for chunk in held:
                yield chunk
            self._spent(held[-1] if held else last)
            return
        raise AssertionError("unreachable")

    async def prepick(self, prep: Prepared, n: int) -> None:
        """Pick the workers of choices 0..n-1 now, so that "no worker" is the response's
        status (503) rather than an error event after a 200 has been sent."""
        exclude = await self._exclude("llm", prep.workers)
        # One after another, in this process: each pick sees the load of those before it
        # (and no task is made per pick).
        for i in range(n):
            prep.picked[i] = await self._pick(prep, exclude)

    def release(self, preps: list[Prepared]) -> None:
        """Hand back picks no stream used (the client left first): neutral outcomes."""
        for prep in preps:
            for picked in prep.picked.values():
                self.backends.report(picked, False, "CANCELLED")
            prep.picked.clear()

    async def _pick(self, prep: Prepared, exclude: tuple[str, ...]) -> Picked:
        # Token ids: the strategy weighs their blocks (kv_aware); media: the role's default.
        strategy = self.settings.llm_strategy if prep.token_ids is not None else ""
        pick = self.backends.pick(
            "llm",
            "generate",
            strategy=strategy,
            namespace=prep.namespace,
            hashes=prep.hashes,
            exclude=exclude,
        )
        return await _served(prep.model, pick)

    def _spent(self, last: GenChunk | None) -> None:
        """Count a finished generation's tokens against its tenant's minute."""
        if self.share is not None and last is not None:
            tokens = last.prompt_tokens + last.completion_tokens
            self.share.spent(policy.current().tenant, tokens)

    def _report(self, picked: Picked, ok: bool, code: str = "") -> None:
        self.backends.report(picked, ok, code)

    async def merged(
        self, preps: list[Prepared], n: int, whole: bool = False
    ) -> AsyncIterator[tuple[int, GenChunk]]:
        """Every choice of every prompt, interleaved as they stream: (choice index, chunk).

        Choice indexes run prompt by prompt: prompt p's choice j is ``p * n + j``. With
        ``whole`` (a non-streamed answer), each choice comes once it ended (see generate).
        """
        if len(preps) == 1 and n == 1:  # the common case: no tasks, no queue
            async with aclosing(self.generate(preps[0], 0, whole)) as stream:
                async for chunk in stream:
                    yield 0, chunk
            return
        queue: asyncio.Queue[tuple[int, GenChunk | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, prep: Prepared, j: int) -> None:
            try:
                async with aclosing(self.generate(prep, j, whole)) as stream:
                    async for chunk in stream:
                        queue.put_nowait((index, chunk))
                queue.put_nowait((index, None))
            except Exception as exc:
                queue.put_nowait((index, exc))

        tasks = [
            asyncio.create_task(pump(p * n + j, prep, j))
            for p, prep in enumerate(preps)
            for j in range(n)
        ]
        try:
            left = len(tasks)
            while left:
                index, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()  # the client left or a choice failed: end the others' calls
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ other roles

    async def image(
        self, model: str, prompt: str, width: int, height: int, seed: int | None
    ) -> bytes:
        workers = await self.workers_for(model, "diffusion")
        exclude = await self._exclude("diffusion", workers)
        picked = await _served(
            model, self.backends.pick("diffusion", "generate_image", exclude=exclude)
        )
        try:
            png = await self.backends.generate_image(
                picked.address, new_id("img"), prompt, width, height, seed
            )
        except OmniflowError as exc:
            self._report(picked, False, exc.code_name)
            raise
        self._report(picked, True)
        return png

    async def speech(self, model: str, text: str, voice: str, sample_rate: int = 0) -> bytes:
        """``text`` spoken by a talker of ``model``: one WAV file at ``sample_rate`` (0: the
        talker's default). OpenAI's voice names ask for the talker's own voice."""
        workers = await self.workers_for(model, "talker")
        exclude = await self._exclude("talker", workers)
        picked = await _served(model, self.backends.pick("talker", "synthesize", exclude=exclude))
        try:
            wav = await self.backends.synthesize(
                picked.address, new_id("tts"), text, talker_voice(voice), sample_rate
            )
        except OmniflowError as exc:
            self._report(picked, False, exc.code_name)
            raise
        self._report(picked, True)
        return wav

    async def invoke(
        self,
        model: str,
        role: str,
        operation: str,
        inputs: dict[str, Any],
        workers: list[WorkerRecord] | None = None,
    ) -> dict[str, Any]:
        """``operation`` of a ``role`` worker serving ``model`` (embed, transcribe), through
        ``Invoke``; the router picks among ``workers`` (default: those of ``model``)."""
        workers = workers or await self.workers_for(model, role)
        exclude = await self._exclude(role, workers)
        picked = await _served(model, self.backends.pick(role, operation, exclude=exclude))
        try:
            out = await self.backends.invoke(picked.address, new_id(role), operation, inputs)
        except OmniflowError as exc:
            self._report(picked, False, exc.code_name)
            raise
        self._report(picked, True)
        return out

    async def workflow_info(self, name: str) -> WorkflowInfo:
        """The registered graph of workflow ``name`` (its ports, outputs and call nodes)."""
        try:
            return await self.backends.workflow(name)
        except NotFound:
            raise NotFound(
                f"model {WORKFLOW_PREFIX + name!r} is not a registered workflow "
                "(GET /v1/models lists them)"
            ) from None

    def run_workflow(
        self,
        name: str,
        inputs: dict[str, Any],
        node_params: dict[str, dict[str, Any]] | None = None,
    ) -> AsyncIterator[RunChunk]:
        """One run through the coordinator: its streamed chunks, then its outputs.
        ``node_params``: params over named top-level nodes' own, for this run."""
        return self.backends.run_workflow(name, inputs, node_params)


async def _served(model: str, pick: Awaitable[Picked]) -> Picked:
    """A pick for a model the catalog knows: the router finding no live worker for it is
    a 503 (no worker now), not a 404 (no such model)."""
    try:
        return await pick
    except NotFound as exc:
        raise Unavailable(f"no live worker serves model {model!r} right now ({exc})") from None


def _for_prompt(
    sampling: SamplingParams, workers: list[WorkerRecord], prompt_len: int, pre: Preprocessor
) -> SamplingParams:
    """The sampling sent for a prompt of ``prompt_len`` tokens, checked before any byte is
    streamed (a 400 naming the field): token ids against the tokenizer's vocabulary,
    ``max_tokens`` against the workers' context length; the model's EOS ids as stop ids."""
    sampling.validate(pre.tokenizer.get_vocab_size(with_added_tokens=True))
    contexts = [w.metadata.get("context_length", "") for w in workers]
    known = [int(c) for c in contexts if c.isdigit()]
    if known:
        sampling.resolved(prompt_len, min(known))
    return sampling.with_eos(pre.eos_token_ids)


async def _off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread, or inline for a short prompt: a thread hop costs more
    than templating and tokenizing a few hundred characters, and a long prompt on the
    loop would stall every stream the gateway is serving."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _chat_ids(
    pre: Preprocessor, messages: Sequence[dict[str, Any]], template: dict[str, Any]
) -> tuple[list[int], list[bytes]]:
    ids = pre.encode_chat(messages, **{"add_generation_prompt": True, **template})
    return ids, pre.block_hashes(ids)


def _text_ids(pre: Preprocessor, text: str) -> tuple[list[int], list[bytes]]:
    ids = pre.encode_text(text)
    return ids, pre.block_hashes(ids)


def _media_parts(content: str | list[dict[str, Any]], i: int) -> list[str | MediaPart]:
    if isinstance(content, str):
        return [content]
    out: list[str | MediaPart] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if part["type"] == "text":
            out.append(part["text"])
        elif part["type"] == "input_audio":
            raise InvalidArgument(
                f"{where}: input_audio is heard by workflow models (such as "
                f"{WORKFLOW_PREFIX}omni_chat, GET /v1/models lists them), not by an llm model"
            )
        else:
            out.append(data_url(part["image_url"]["url"], f"{where}.image_url.url"))
    return out
