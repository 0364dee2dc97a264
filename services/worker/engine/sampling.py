"""Sampling parameters, their validation, and the sampler over a batch of logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniflow.errors import InvalidArgument

GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next tokens.

    ``temperature`` 0 means greedy. ``top_k`` 0 disables top-k; ``top_p`` 1 and ``min_p`` 0
    disable those filters; ``repetition_penalty`` 1 disables it (transformers' rule: a seen
    token's positive logit is divided by it, a negative one multiplied). ``seed`` makes
    sampling reproducible per request. Generation stops at ``max_tokens``, at an EOS id
    (unless ``ignore_eos``), at any of ``stop_token_ids`` or when the text contains one of
    ``stop`` (the stop string is cut from the text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self, vocab_size: int) -> None:
        """Raise ``InvalidArgument`` naming the accepted range of the first bad field."""
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidArgument(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 <= self.top_k <= vocab_size:
            raise InvalidArgument(
                f"top_k must be in [0, {vocab_size}] (0 disables it), got {self.top_k}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidArgument(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed must be in [0, 2^63), got {self.seed}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise InvalidArgument(
                    f"stop token id {t} is outside the vocabulary [0, {vocab_size})"
                )
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidArgument(
                f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}"
            )


def _apply_repetition_penalty(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    vals = row.index_select(0, seen)
    vals = torch.where(vals > 0, vals / penalty, vals * penalty)
    row.index_copy_(0, seen, vals)


def _filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled, filtered logits (filtered entries at -inf)."""
    row = row / p.temperature
    neg = torch.finfo(row.dtype).min
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, neg)
    if p.top_p < 1.0:
        sorted_vals, order = torch.sort(row, descending=True)
        probs = sorted_vals.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top token stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        row = row.masked_fill(drop, neg)
    if p.min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), neg)
    return row


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seen: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of ``logits`` [n, vocab] (float32).

    ``seen[i]`` holds the distinct token ids already in request i (prompt and output) when it
    uses a repetition penalty; ``generators[i]`` is its random source when it samples.
    """
    logits = logits.clone()
    for i, p in enumerate(params):
        s = seen[i]
        if p.repetition_penalty != 1.0 and s is not None and s.numel():
            _apply_repetition_penalty(logits[i], s, p.repetition_penalty)
    chosen = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filter(logits[i], p).softmax(-1)
        chosen[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return chosen
