"""The diffusion role: prompts prefilled by the LLM engine, images denoised on its backbone.

The role holds no copy of the backbone: ``ImageHead`` points at the engine's
``DecoderModel``, so an LLM role and this role in one process share one set of weights,
and the prompt pages live in the engine's pool under the LLM's KV namespace (cached
across requests, published, fetchable from another worker through the agents).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from omniflow.errors import InvalidArgument
from omniflow_services.worker.engine import Engine, GenerateRequest, SamplingParams
from omniflow_services.worker.mm.diffusion import (
    ImageHead,
    PromptKV,
    flow_euler,
    initial_noise,
    png_bytes,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ImageRequest:
    """One text-to-image request; token ids are the chat-formatted prompts."""

    request_id: str
    prompt_ids: list[int]
    negative_ids: list[int]
    width: int
    height: int
    steps: int
    guidance: float
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class ImageResult:
    png: bytes
    latents: torch.Tensor
    width: int
    height: int
    prompt_tokens: int
    cached_prompt_tokens: int


class DiffusionRole:
    """Text-to-image over the engine's backbone (one denoise at a time)."""

    def __init__(self, engine: Engine, head: ImageHead) -> None:
        if head.model is not engine.model:
            raise InvalidArgument("the image head must sit on the engine's own backbone")
        self.engine = engine
        self.head = head
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    async def load(cls, head_folder: Path, engine: Engine) -> DiffusionRole:
        head = await asyncio.to_thread(ImageHead, head_folder, engine.model, engine.config.device)
        return cls(engine, head)

    @property
    def defaults(self) -> dict:
        return self.head.cfg

    async def prefill(self, request_id: str, ids: list[int]) -> tuple[PromptKV, int]:
        """The prompt's K/V through the engine (prefix cache and connector included) and
        how many of its tokens were already cached."""
        req = GenerateRequest(
            request_id,
            prompt_token_ids=ids,
            params=SamplingParams(max_tokens=1, temperature=0.0),
            return_kv=True,
        )
        kv = None
        cached = 0
        async for out in self.engine.generate(req):
            if out.kv is not None:
                kv = out.kv
            cached = out.usage.cached_tokens
        if kv is None:
            raise RuntimeError(f"the engine returned no prompt K/V for {request_id}")
        return PromptKV(kv[0], kv[1]), cached

    def _check(self, req: ImageRequest) -> None:
        self.head.check_size(req.width, req.height)
        top = int(self.head.cfg["max_steps"])
        if not 1 <= req.steps <= top:
            raise InvalidArgument(f"steps {req.steps} is not accepted; accepted: 1..{top}")
        if not 0.0 <= req.guidance <= 50.0:
            raise InvalidArgument(f"guidance_scale {req.guidance} is not accepted; accepted: 0..50")
        if not req.prompt_ids:
            raise InvalidArgument("the prompt is empty")

    async def generate(self, req: ImageRequest) -> ImageResult:
        self._check(req)
        n = next(self._ids)
        use_cfg = req.guidance != 1.0
        cond, cached = await self.prefill(f"{req.request_id}#cond{n}", req.prompt_ids)
        uncond = None
        if use_cfg:
            uncond, _ = await self.prefill(f"{req.request_id}#uncond{n}", req.negative_ids)
        latents = await asyncio.to_thread(self._denoise, req, cond, uncond)
        rgb = await asyncio.to_thread(self.head.decode, latents)
        return ImageResult(
            png_bytes(rgb),
            latents.cpu(),
            req.width,
            req.height,
            len(req.prompt_ids),
            cached,
        )

    def _denoise(self, req: ImageRequest, cond: PromptKV, uncond: PromptKV | None) -> torch.Tensor:
        noise = initial_noise(self.head.latent_shape(req.width, req.height), req.seed)
        noise = noise.to(self.head.image_start.device)  # seeded on the CPU: same on any device
        head = self.head
        with self._lock:
            return flow_euler(
                lambda x, t: head.velocity(x, t, cond),
                (lambda x, t: head.velocity(x, t, uncond)) if uncond is not None else None,
                noise,
                req.steps,
                req.guidance,
            )
