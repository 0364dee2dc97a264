"""The sampler's filters against transformers' logits processors, row by row."""

from __future__ import annotations

import pytest
import torch

from omniflow_services.worker.engine.sampling import SamplingParams, _filter, sample

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
    for i in range(logits.shape[0]):
        ours = _filter(logits[i], params)
        keep_ours = ours > torch.finfo(ours.dtype).min
        keep_ref = torch.isfinite(ref[i])
        assert torch.equal(keep_ours, keep_ref)
        torch.testing.assert_close(ours[keep_ours], ref[i][keep_ref])


def test_repetition_penalty_matches_transformers() -> None:
    logits = _rows(1)
    seen = torch.tensor([3, 17, 42, 199])
    proc = transformers.RepetitionPenaltyLogitsProcessor(1.7)
    ref = proc(seen[None, :], logits.clone())
    p = SamplingParams(temperature=0.0, repetition_penalty=1.7)
    assert sample(logits, [p], [seen], [None]) == [int(ref[0].argmax())]
    # A penalised row changes the choice when the top token was seen.
    top = int(logits[0].argmax())
    strong = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    assert sample(logits, [strong], [torch.tensor([top])], [None])[0] != top


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]])
    p = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[sample(logits, [p], [None], [gen])[0]] += 1
    expected = torch.softmax(logits[0], -1) * 3000
    assert counts[3] == 0
    assert torch.allclose(counts[:3], expected[:3], rtol=0.15)
