"""The llm role over the built-in engine: ``EngineRole`` (no gRPC here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

from omniflow.sampling import SamplingParams
from omniflow.security.kvsalt import salted_extra_keys
from omniflow_services.worker.engine.config import EngineConfig
from omniflow_services.worker.engine.engine import Engine
from omniflow_services.worker.llm.role import LLMRole
from omniflow_services.worker.llm.types import GenerateRequest, RequestOutput


class EngineRole(LLMRole):
    """``LLMRole`` served by the built-in PyTorch engine."""

    engine: Engine
    features = ("logprobs", "penalties")
    kv_attach = True

    @classmethod
    async def load(cls, model_dir: Path, config: EngineConfig) -> EngineRole:
        # Loading reads weights and may take seconds: keep the event loop answering health.
        engine = await asyncio.to_thread(Engine, model_dir, config)
        return await asyncio.to_thread(cls, engine, model_dir)  # reads the chat template

    def context_length(self) -> int:
        return int(self.engine.max_model_len)

    async def warm_up(self) -> None:
        req = GenerateRequest("warm-up", prompt_token_ids=[0, 1, 2], params=SamplingParams(1, 0.0))
        async for _ in self.engine.generate(req):
            pass

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
