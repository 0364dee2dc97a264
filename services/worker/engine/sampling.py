"""The sampler over a batch of logits rows (the parameters are the library's contract,
``omniflow.sampling.SamplingParams``, re-exported here).

The sampler works on the whole batch at once: logit bias, min-tokens masking, penalties,
temperature, top-k/top-p/min-p and the random draw are tensor operations over the rows that
need them, never a Python loop per row (except drawing noise for requests that carry their
own seed). Penalty state is kept per request and updated by one token per step
(``PenaltyState``), not rebuilt from the tokens. The order is vLLM's: bias and min-tokens
masking, then penalties, then temperature and filters; logprobs are of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniflow.sampling import SamplingParams
from omniflow_services.worker.llm.types import TopLogprobs

__all__ = ["PenaltyState", "SampleOutput", "SamplingParams", "TopLogprobs", "sample"]


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


def _bias_and_mask(
    logits: torch.Tensor, params: list[SamplingParams], masked: list[frozenset[int] | None]
) -> torch.Tensor:
    """``logits`` with each row's ``logit_bias`` added and its ``masked`` ids (the stop ids
    of a request still short of its ``min_tokens``) at -inf; the input when no row has
    either. Ids outside the vocabulary are ignored (the engine's validation refuses them)."""
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    mask_rows = [i for i, m in enumerate(masked) if m]
    if not bias_rows and not mask_rows:
        return logits
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[-1]
    if bias_rows:
        rows, cols, vals = [], [], []
        for i in bias_rows:
            for t, b in params[i].logit_bias:
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
                    vals.append(b)
        if rows:
            logits.index_put_(
                (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                torch.tensor(vals, dtype=logits.dtype, device=dev),
                accumulate=True,
            )
    if mask_rows:
        pairs = [(i, t) for i in mask_rows for t in masked[i] or () if 0 <= t < vocab]
        if pairs:
            r, c = zip(*pairs, strict=True)
            logits[torch.tensor(r, device=dev), torch.tensor(c, device=dev)] = -torch.inf
    return logits


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
    masked: list[frozenset[int] | None] | None = None,
) -> SampleOutput:
    """Pick one token per row of ``logits`` [n, vocab] (float32).

    ``states[i]`` holds request i's penalty statistics when it uses a penalty;
    ``generators[i]`` is its random source when it samples with a seed (else the global one);
    ``masked[i]`` are ids request i may not pick this step (its stop ids before
    ``min_tokens``). Logprobs are of ``logits`` as given (raw).
    """
    n = len(params)
    states = states if states is not None else [None] * n
    generators = generators if generators is not None else [None] * n
    masked = masked if masked is not None else [None] * n
    penalised = _apply_penalties(_bias_and_mask(logits, params, masked), params, states)
    chosen = penalised.argmax(-1)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        idx = torch.tensor(rand, device=logits.device)
        chosen.index_copy_(0, idx, _draw(penalised, params, generators, rand))
    lps, tops = _logprobs(logits, params, chosen)
    return SampleOutput(chosen.tolist(), lps, tops)
