"""The llm role: the built-in engine behind the worker API (no gRPC here).

Prompts become token ids through the model's own chat template and tokenizer
(``omniflow.chat.Preprocessor``, the same implementation the gateway and the coordinator
use), always on a thread, never on the event loop; the prompt's block hashes are reported
with the result, and the engine's outputs are streamed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from omniflow.chat import Preprocessor
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import block_hashes
from omniflow.security.kvsalt import salted_extra_keys
from omniflow.security.tenancy import scoped_id
from omniflow_services.worker.engine import (
    Engine,
    EngineConfig,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)


class LLMRole:
    """One engine, shared by every Generate call of the worker."""

    def __init__(self, engine: Engine, model_dir: Path) -> None:
        self.engine = engine
        self.model_dir = model_dir
        self._ids = itertools.count()
        self._prep: Preprocessor | None = None
        if engine.tokenizer is not None:
            layout = engine.layout
            self._prep = Preprocessor.from_folder(
                model_dir, layout.namespace, layout.page_size, tokenizer=engine.tokenizer
            )

    @classmethod
    async def load(cls, model_dir: Path, config: EngineConfig) -> LLMRole:
        # Loading reads weights and may take seconds: keep the event loop answering health.
        engine = await asyncio.to_thread(Engine, model_dir, config)
        return await asyncio.to_thread(cls, engine, model_dir)  # reads the chat template

    @property
    def kv_namespace(self) -> str:
        return self.engine.layout.namespace_hex

    def context_length(self) -> int:
        """Prompt + generated tokens a request may hold (advertised as ``context_length``)."""
        return int(self.engine.max_model_len)

    async def warm_up(self) -> None:
        """One tiny generation, so that the first user request pays no first-call costs."""
        req = GenerateRequest("warm-up", prompt_token_ids=[0, 1, 2], params=SamplingParams(1, 0.0))
        async for _ in self.engine.generate(req):
            pass

    @property
    def prep(self) -> Preprocessor:
        """The model's template and tokenizer; InvalidArgument when it has no tokenizer."""
        if self._prep is None:
            raise InvalidArgument(
                f"model {self.model_dir.name} has no tokenizer.json: text and messages "
                "prompts need one; send token_ids"
            )
        return self._prep

    async def encode_text(self, text: str) -> list[int]:
        """A completion prompt's ids (the tokenizer's special tokens added), off the loop."""
        return await self.prep.aencode_text(text)

    async def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Messages through the model's chat template, tokenized once, off the loop."""
        return await self.prep.aencode_chat(messages, add_generation_prompt)

    def prompt_hashes(self, ids: Sequence[int]) -> list[bytes]:
        layout = self.engine.layout
        return block_hashes(layout.namespace, ids, layout.page_size, salted_extra_keys(None))

    def request_id(self, given: str) -> tuple[str, str]:
        """(the id the caller sees, the engine's id): ``given`` or an unguessable one, and
        that id scoped to the caller's tenant, so that an Abort names the caller's own
        request only (``abort``)."""
        shown = given or f"gen-{secrets.token_hex(16)}"
        return shown, scoped_id(shown)

    def abort(self, given: str) -> bool:
        """Abort the caller's own request ``given`` (another tenant's is not found)."""
        return self.engine.abort(scoped_id(given))

    async def generate(
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if params.structured is not None:  # compiled off the loop (cached for the engine)
            await asyncio.to_thread(self.engine.grammars.compile, params.structured)
        # The caller's tenant salts the prompt's block hashes: its pages are its own.
        extra = salted_extra_keys(None)
        req = GenerateRequest(request_id, prompt_token_ids=ids, params=params, extra_keys=extra)
        async with aclosing(self.engine.generate(req)) as stream:
            async for out in stream:
                yield out
