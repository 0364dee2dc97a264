"""``LLMRole``: what the worker's edge serves an llm engine through (no gRPC here).

Prompts become token ids through the model's own chat template and tokenizer
(``omniflow.chat.Preprocessor``, the same implementation the gateway and the coordinator
use), always on a thread, never on the event loop; the prompt's block hashes are reported
with the result, and the engine's outputs (``llm.types.RequestOutput``) are streamed.

Each engine subclasses it: the built-in one (``engine.role.EngineRole``), vLLM and SGLang
(``llm.backends.BackendRole``), the echo test engine (``echo.role.EchoRole``). Its
``engine`` has ``layout`` (a ``KVLayout``), ``tokenizer`` (or None), ``load()`` (an
``EngineLoad``) and ``abort(request_id)``.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omniflow.chat import Preprocessor
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import block_hashes
from omniflow.sampling import SamplingParams
from omniflow.security.kvsalt import salted_extra_keys
from omniflow.security.tenancy import scoped_id
from omniflow_services.worker.llm.types import RequestOutput


class LLMRole:
    """One engine, shared by every Generate call of the worker."""

    #: Sampling features beyond the common ones this engine serves (advertised next to the
    #: operations, so that a caller can refuse a field rather than have it ignored).
    features: tuple[str, ...] = ()
    #: Whether the worker attaches the engine's device pool to the node's kv-agent itself
    #: (``WorkerKV``); engines that share pages their own way leave it False.
    kv_attach: bool = False

    def __init__(self, engine: Any, model_dir: Path) -> None:
        self.engine = engine
        self.model_dir = model_dir
        self._prep: Preprocessor | None = None
        if engine.tokenizer is not None:
            layout = engine.layout
            self._prep = Preprocessor.from_folder(
                model_dir, layout.namespace, layout.page_size, tokenizer=engine.tokenizer
            )

    @property
    def kv_namespace(self) -> str:
        return self.engine.layout.namespace_hex

    def context_length(self) -> int:
        """Prompt + generated tokens a request may hold (advertised as ``context_length``)."""
        raise NotImplementedError

    async def warm_up(self) -> None:
        """One tiny generation, so that the first user request pays no first-call costs."""
        raise NotImplementedError

    def generate(
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, streamed; closing the stream aborts the request."""
        raise NotImplementedError

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
        return bool(self.engine.abort(scoped_id(given)))
