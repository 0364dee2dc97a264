"""Sampling parameters, their validation, and the sampler over a batch of logits rows.

The sampler works on the whole batch at once: penalties, temperature, top-k/top-p/min-p and
the random draw are tensor operations over the rows that need them, never a Python loop per
row (except drawing noise for requests that carry their own seed). Penalty state is kept per
request and updated by one token per step (``PenaltyState``), not rebuilt from the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniflow.errors import InvalidArgument

GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next tokens.

    ``temperature`` 0 means greedy. ``top_k`` 0 disables top-k; ``top_p`` 1 and ``min_p`` 0
    disable those filters; ``repetition_penalty`` 1 disables it (transformers' rule: a seen
    token's positive logit is divided by it, a negative one multiplied). ``presence_penalty``
    and ``frequency_penalty`` follow OpenAI (``logit - presence * (count > 0) - frequency *
    count``, counting the tokens generated so far, as vLLM does). ``seed`` makes sampling
    reproducible per request. ``logprobs`` returns each sampled token's log-probability and
    ``top_logprobs`` that many alternatives, both of the model's distribution before
    penalties, temperature and filters (vLLM's default "raw" logprobs). Generation stops at
    ``max_tokens``, at an EOS id (unless ``ignore_eos``), at any of ``stop_token_ids`` or
    when the text contains one of ``stop`` (the stop string is cut from the text).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2] (0 disables it), got {v}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs=true")
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


class PenaltyState:
    """One request's token statistics for its penalties, updated one token at a time.

    ``seen`` marks every vocabulary id of the prompt and output (repetition penalty);
    ``counts`` counts the generated ids (presence and frequency penalties). Ids outside the
    vocabulary (media pad ids) are ignored.
    """

    __slots__ = ("counts", "seen")

    def __init__(
        self, p: SamplingParams, prompt: list[int], vocab: int, device: torch.device
    ) -> None:
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        if p.repetition_penalty != 1.0:
            ids = torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.long)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[ids.to(device)] = True
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)

    def add(self, token: int) -> None:
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1.0


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """The most likely alternatives at one position, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """Per row: the chosen token and, when asked, its logprob and the top alternatives."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]


def filter_logits(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Rows of ``x`` [m, vocab] (already temperature-scaled) with filtered entries at -inf.

    ``top_k`` [m] (0: off), ``top_p`` [m] (1: off) and ``min_p`` [m] (0: off) apply per row,
    in that order, with transformers' rules.
    """
    neg = torch.finfo(x.dtype).min
    vocab = x.shape[-1]
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1.0).any())
    if use_k or use_p:
        sorted_vals, order = torch.sort(x, dim=-1, descending=True)
        if use_k:
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            kth = sorted_vals.gather(1, (k - 1)[:, None])
            x = x.masked_fill(x < kth, neg)
            sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, neg)
        if use_p:
            probs = sorted_vals.softmax(-1)
            # Drop a token when the mass before it already reaches top_p; the top token stays.
            # Rows with top_p 1 get an unreachable threshold (float rounding could reach 1).
            thr = torch.where(top_p < 1.0, top_p, torch.inf)[:, None]
            drop_sorted = (probs.cumsum(-1) - probs) >= thr
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            x = x.masked_fill(drop, neg)
    if bool((min_p > 0.0).any()):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), neg)
    return x


def _apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], states: list[PenaltyState | None]
) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.penalised and states[i] is not None]
    if not rows:
        return logits
    logits = logits.clone()
    dev = logits.device
    rep = [i for i in rows if states[i].seen is not None]  # type: ignore[union-attr]
    if rep:
        idx = torch.tensor(rep, device=dev)
        seen = torch.stack([states[i].seen for i in rep])  # type: ignore[union-attr,misc]
        pen = torch.tensor([params[i].repetition_penalty for i in rep], device=dev)[:, None]
        x = logits.index_select(0, idx)
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
        logits.index_copy_(0, idx, x)
    opn = [i for i in rows if states[i].counts is not None]  # type: ignore[union-attr]
    if opn:
        idx = torch.tensor(opn, device=dev)
        counts = torch.stack([states[i].counts for i in opn])  # type: ignore[union-attr,misc]
        pres = torch.tensor([params[i].presence_penalty for i in opn], device=dev)[:, None]
        freq = torch.tensor([params[i].frequency_penalty for i in opn], device=dev)[:, None]
        x = logits.index_select(0, idx) - freq * counts - pres * (counts > 0).float()
        logits.index_copy_(0, idx, x)
    return logits


def _draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    rows: list[int],
) -> torch.Tensor:
    """Sampled ids for ``rows`` (the exponential race: argmax p / E, E ~ Exp(1))."""
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    ps = [params[i] for i in rows]
    temp = torch.tensor([p.temperature for p in ps], device=dev)[:, None]
    x = filter_logits(
        logits.index_select(0, idx) / temp,
        torch.tensor([p.top_k for p in ps], device=dev),
        torch.tensor([p.top_p for p in ps], device=dev),
        torch.tensor([p.min_p for p in ps], device=dev),
    )
    probs = x.softmax(-1)
    noise = torch.empty_like(probs).exponential_()  # unseeded rows: the global generator
    for j, i in enumerate(rows):
        g = generators[i]
        if g is not None:  # a seeded request draws from its own stream
            noise[j].exponential_(generator=g)
    return (probs / noise).argmax(-1)


def _logprobs(
    raw: torch.Tensor, params: list[SamplingParams], chosen: torch.Tensor
) -> tuple[list[float | None], list[TopLogprobs | None]]:
    n = len(params)
    lp_out: list[float | None] = [None] * n
    top_out: list[TopLogprobs | None] = [None] * n
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return lp_out, top_out
    idx = torch.tensor(rows, device=raw.device)
    lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
    picked = lp.gather(1, chosen.index_select(0, idx)[:, None])[:, 0].tolist()
    kmax = max(params[i].top_logprobs for i in rows)
    top_v: list[list[float]] = []
    top_i: list[list[int]] = []
    if kmax:
        v, t = torch.topk(lp, kmax, dim=-1)
        top_v, top_i = v.tolist(), t.tolist()
    for j, i in enumerate(rows):
        lp_out[i] = picked[j]
        k = params[i].top_logprobs
        if k:
            top_out[i] = TopLogprobs(tuple(top_i[j][:k]), tuple(top_v[j][:k]))
    return lp_out, top_out


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[PenaltyState | None] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SampleOutput:
    """Pick one token per row of ``logits`` [n, vocab] (float32).

    ``states[i]`` holds request i's penalty statistics when it uses a penalty;
    ``generators[i]`` is its random source when it samples with a seed (else the global one).
    """
    n = len(params)
    states = states if states is not None else [None] * n
    generators = generators if generators is not None else [None] * n
    penalised = _apply_penalties(logits, params, states)
    chosen = penalised.argmax(-1)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        idx = torch.tensor(rand, device=logits.device)
        chosen.index_copy_(0, idx, _draw(penalised, params, generators, rand))
    lps, tops = _logprobs(logits, params, chosen)
    return SampleOutput(chosen.tolist(), lps, tops)
