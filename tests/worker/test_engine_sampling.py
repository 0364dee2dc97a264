"""The sampler's filters against transformers' logits processors, row by row, and the batched
sampler's penalties and random draws."""

from __future__ import annotations

import pytest
import torch

from omniflow_services.worker.engine.sampling import (
    PenaltyState,
    SamplingParams,
    filter_logits,
    sample,
)

transformers = pytest.importorskip("transformers", reason="reference processors")


def _rows(n: int = 6, vocab: int = 200) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize(
    ("params", "warpers"),
    [
        (SamplingParams(temperature=0.7, top_k=13), lambda: [transformers.TopKLogitsWarper(13)]),
        (SamplingParams(temperature=0.7, top_p=0.8), lambda: [transformers.TopPLogitsWarper(0.8)]),
        (
            SamplingParams(temperature=0.7, min_p=0.05),
            lambda: [transformers.MinPLogitsWarper(0.05)],
        ),
        (
            SamplingParams(temperature=1.2, top_k=40, top_p=0.9, min_p=0.02),
            lambda: [
                transformers.TopKLogitsWarper(40),
                transformers.TopPLogitsWarper(0.9),
                transformers.MinPLogitsWarper(0.02),
            ],
        ),
    ],
)
def test_filters_keep_the_same_tokens_as_transformers(params: SamplingParams, warpers) -> None:  # type: ignore[no-untyped-def]
    logits = _rows()
    ref = logits / params.temperature
    for w in warpers():
        ref = w(None, ref)
    n = logits.shape[0]
    batch = filter_logits(
        logits / params.temperature,
        torch.full((n,), params.top_k),
        torch.full((n,), params.top_p),
        torch.full((n,), params.min_p),
    )
    for i in range(n):
        ours = batch[i]
        keep_ours = ours > torch.finfo(ours.dtype).min
        keep_ref = torch.isfinite(ref[i])
        assert torch.equal(keep_ours, keep_ref)
        torch.testing.assert_close(ours[keep_ours], ref[i][keep_ref])


def test_repetition_penalty_matches_transformers() -> None:
    logits = _rows(1)
    seen = [3, 17, 42, 199]
    proc = transformers.RepetitionPenaltyLogitsProcessor(1.7)
    ref = proc(torch.tensor([seen]), logits.clone())
    p = SamplingParams(temperature=0.0, repetition_penalty=1.7)
    state = PenaltyState(p, seen, 200, torch.device("cpu"))
    assert sample(logits, [p], [state]).tokens == [int(ref[0].argmax())]
    # A penalised row changes the choice when the top token was seen.
    top = int(logits[0].argmax())
    strong = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    state = PenaltyState(strong, [top], 200, torch.device("cpu"))
    assert sample(logits, [strong], [state]).tokens[0] != top


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]])
    p = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[sample(logits, [p], None, [gen]).tokens[0]] += 1
    expected = torch.softmax(logits[0], -1) * 3000
    assert counts[3] == 0
    assert torch.allclose(counts[:3], expected[:3], rtol=0.15)


def test_a_mixed_batch_samples_each_row_by_its_own_params() -> None:
    """Greedy, seeded and filtered rows in one call: each row as if sampled alone."""
    logits = _rows(5)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.0, top_k=1, seed=3),  # top-1: must be the argmax
        SamplingParams(temperature=0.5, top_p=0.3, min_p=0.1, seed=11),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0),
    ]
    states = [
        PenaltyState(p, [], 200, torch.device("cpu")) if p.penalised else None for p in params
    ]
    top = int(logits[4].argmax())
    states[4].add(top)  # type: ignore[union-attr]

    def gens() -> list[torch.Generator | None]:
        return [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params
        ]

    together = sample(logits, params, states, gens()).tokens
    assert together == sample(logits, params, states, gens()).tokens  # seeds reproduce
    assert together[0] == int(logits[0].argmax())
    assert together[2] == int(logits[2].argmax())
    for i in (1, 3):
        alone = sample(logits[i : i + 1], [params[i]], None, [gens()[i]]).tokens[0]
        assert together[i] == alone
    penalised = logits[4].clone()
    penalised[top] -= 2.0 + 1.0
    assert together[4] == int(penalised.argmax())


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = _rows(3)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4),
        SamplingParams(temperature=0.3, top_k=5, logprobs=True, seed=1),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, params, None, [None, torch.Generator().manual_seed(1), None])
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[0] == pytest.approx(float(ref[0, out.tokens[0]]), abs=1e-6)
    assert out.logprobs[1] == pytest.approx(float(ref[1, out.tokens[1]]), abs=1e-6)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[1] is None
    top = out.top_logprobs[0]
    assert top is not None
    v, i = torch.topk(ref[0], 4)
    assert top.token_ids == tuple(i.tolist())
    assert top.logprobs == pytest.approx(v.tolist(), abs=1e-6)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2]"),
        ("top_logprobs", 21, "top_logprobs must be in [0, 20]"),
    ],
)
def test_bad_new_fields_are_named(field: str, value: object, message: str) -> None:
    from omniflow.errors import InvalidArgument

    kw = {field: value, "logprobs": True}
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kw).validate(100)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="top_logprobs needs logprobs=true"):
        SamplingParams(top_logprobs=3).validate(100)


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    """A one-token logit bias is transformers' SequenceBiasLogitsProcessor over 1-token
    sequences; greedy and sampled rows in one batch each take their own bias."""
    logits = _rows(3)
    bias = {5: 40.0, 17: -100.0, int(logits[1].argmax()): -100.0}
    proc = transformers.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    ref = proc(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    pairs = tuple(sorted(bias.items()))
    params = [
        SamplingParams(temperature=0.0, logit_bias=pairs),
        SamplingParams(temperature=0.0, logit_bias=pairs),
        SamplingParams(temperature=0.0),  # no bias: its own argmax
    ]
    got = sample(logits, params).tokens
    assert got[:2] == [int(ref[0].argmax()), int(ref[1].argmax())]
    assert got[2] == int(logits[2].argmax())
    # Logprobs stay those of the raw logits (vLLM's default), bias or not.
    lp = sample(logits, [SamplingParams(temperature=0.0, logit_bias=pairs, logprobs=True)])
    raw = torch.log_softmax(logits[0], -1)[lp.tokens[0]]
    assert lp.logprobs[0] == pytest.approx(float(raw), abs=1e-5)


def test_min_tokens_masks_the_stop_ids_as_transformers() -> None:
    """A row short of min_tokens cannot draw its stop ids: transformers'
    MinNewTokensLengthLogitsProcessor with the same eos ids."""
    logits = _rows(2)
    stops = frozenset({int(logits[0].argmax()), int(logits[1].argmax()), 3})
    proc = transformers.MinNewTokensLengthLogitsProcessor(
        prompt_length_to_skip=0, min_new_tokens=4, eos_token_id=sorted(stops)
    )
    ref = proc(torch.zeros(2, 0, dtype=torch.long), logits.clone())
    p = SamplingParams(temperature=0.0, min_tokens=4)
    got = sample(logits, [p, p], masked=[stops, None]).tokens
    assert got[0] == int(ref[0].argmax()) and got[0] not in stops
    assert got[1] == int(logits[1].argmax())  # past min_tokens: nothing masked
