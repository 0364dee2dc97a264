"""The llm role: the built-in engine behind the worker API (no gRPC here).

Turns chat messages into a prompt with the model's template, tokenizes so that the
prompt's block hashes can be reported, and streams the engine's outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import block_hashes
from omniflow_services.worker.engine import (
    Engine,
    EngineConfig,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    text: str


def chatml(turns: Sequence[ChatTurn], add_generation_prompt: bool = True) -> str:
    """The ChatML prompt of ``turns`` (the template of Qwen2-family models and ours)."""
    if not turns:
        raise InvalidArgument("messages is empty: send at least one message")
    parts = []
    for i, t in enumerate(turns):
        if t.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role {t.role!r} is not accepted; accepted: {', '.join(CHAT_ROLES)}"
            )
        parts.append(f"<|im_start|>{t.role}\n{t.text}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class LLMRole:
    """One engine, shared by every Generate call of the worker."""

    def __init__(self, engine: Engine, model_dir: Path) -> None:
        self.engine = engine
        self.model_dir = model_dir
        self._ids = itertools.count()

    @classmethod
    async def load(cls, model_dir: Path, config: EngineConfig) -> LLMRole:
        # Loading reads weights and may take seconds: keep the event loop answering health.
        engine = await asyncio.to_thread(Engine, model_dir, config)
        return cls(engine, model_dir)

    @property
    def kv_namespace(self) -> str:
        return self.engine.layout.namespace_hex

    async def warm_up(self) -> None:
        """One tiny generation, so that the first user request pays no first-call costs."""
        req = GenerateRequest("warm-up", prompt_token_ids=[0, 1, 2], params=SamplingParams(1, 0.0))
        async for _ in self.engine.generate(req):
            pass

    def tokenize(self, text: str) -> list[int]:
        if self.engine.tokenizer is None:
            raise InvalidArgument("this model has no tokenizer: send token_ids")
        return list(self.engine.tokenizer.encode(text).ids)

    def prompt_hashes(self, ids: Sequence[int]) -> list[bytes]:
        layout = self.engine.layout
        return block_hashes(layout.namespace, ids, layout.page_size)

    def request_id(self, given: str) -> str:
        return given or f"gen-{next(self._ids)}"

    def generate(
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(
            GenerateRequest(request_id, prompt_token_ids=ids, params=params)
        )
