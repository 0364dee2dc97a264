"""What the llm roles over an engine in another process (vLLM, SGLang) share: the prompt
checks our own engine makes before a request goes in, and the warm-up."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from omniflow.errors import InvalidArgument
from omniflow.sampling import SamplingParams
from omniflow_services.worker.llm.role import LLMRole


class BackendRole(LLMRole):
    """An ``LLMRole`` whose engine is a third-party one (``engine.model_config`` is ours)."""

    def __init__(self, engine: Any, model_dir: Path) -> None:
        super().__init__(engine, model_dir)
        self._warm = itertools.count()

    def context_length(self) -> int:
        """Prompt + generated tokens the engine accepts (the model's, unless it says less)."""
        return int(self.engine.model_config.max_position_embeddings)

    def check_prompt(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """InvalidArgument for what the engine would refuse or mishandle: an empty prompt, a
        token outside the vocabulary, bad sampling, more tokens than the context holds. The
        params are returned with ``max_tokens`` decided (unset: up to the context)."""
        vocab = self.engine.model_config.vocab_size
        if not ids:
            raise InvalidArgument("the prompt is empty: send at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        params.validate(vocab)
        return params.resolved(len(ids), self.context_length())

    async def warm_up(self) -> None:
        async for _ in self.generate(
            f"warm-up-{next(self._warm)}", [0, 1, 2], SamplingParams(1, 0.0)
        ):
            pass
