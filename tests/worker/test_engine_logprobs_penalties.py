"""Logprobs and OpenAI presence/frequency penalties of the engine against transformers."""

from __future__ import annotations

import torch
from engine_helpers import ATOL, TinyModel, run_all

from omniflow_services.worker.engine import GenerateRequest, SamplingParams


def _req(rid: str, prompt: list[int], **kw: object) -> GenerateRequest:
    params = SamplingParams(ignore_eos=True, **kw)  # type: ignore[arg-type]
    return GenerateRequest(rid, tuple(prompt), params=params, return_logits=True)


@torch.no_grad()
def test_greedy_logprobs_equal_log_softmax_of_transformers(tiny: TinyModel) -> None:
    prompts = [tiny.prompt(n, seed=20 + n) for n in (9, 30)]
    reqs = [
        _req("a", prompts[0], max_tokens=7, temperature=0.0, logprobs=True, top_logprobs=5),
        _req("b", prompts[1], max_tokens=7, temperature=0.0, logprobs=True),
    ]
    res = run_all(tiny.engine(max_num_batched_tokens=64), reqs)
    for rid, prompt in zip("ab", prompts, strict=True):
        r = res[rid]
        tiny.check(prompt, r)  # the tokens are transformers' greedy tokens
        seq = torch.tensor([prompt + r.tokens[:-1]])
        ref = torch.log_softmax(tiny.hf(seq).logits[0, len(prompt) - 1 :].float(), -1)
        got = torch.tensor([lp for o in r.outputs for lp in (o.logprobs or ())])
        want = ref[torch.arange(len(r.tokens)), torch.tensor(r.tokens)]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        tops = [t for o in r.outputs for t in (o.top_logprobs or ())]
        if rid == "b":
            assert tops == []
            continue
        assert len(tops) == len(r.tokens)
        for pos, top in enumerate(tops):
            assert top is not None and len(top.token_ids) == 5
            assert top.token_ids[0] == r.tokens[pos]  # greedy: the top alternative
            torch.testing.assert_close(
                torch.tensor(top.logprobs), ref[pos, list(top.token_ids)], atol=ATOL, rtol=0
            )


def test_sampled_logprobs_are_before_temperature_and_filters(tiny: TinyModel) -> None:
    prompt = tiny.prompt(12, seed=31)
    req = _req("s", prompt, max_tokens=6, temperature=1.7, top_k=20, seed=5, logprobs=True)
    r = run_all(tiny.engine(), [req])["s"]
    assert r.logits is not None
    want = torch.log_softmax(r.logits, -1)[torch.arange(6), torch.tensor(r.tokens)]
    got = torch.tensor([lp for o in r.outputs for lp in (o.logprobs or ())])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@torch.no_grad()
def _reference_penalised_greedy(
    tiny: TinyModel, prompt: list[int], n: int, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding on transformers' raw logits with OpenAI's penalty formula."""
    seq = list(prompt)
    counts = torch.zeros(tiny.vocab)
    out: list[int] = []
    for _ in range(n):
        logits = tiny.hf(torch.tensor([seq])).logits[0, -1].float()
        adjusted = logits - presence * (counts > 0).float() - frequency * counts
        tok = int(adjusted.argmax())
        counts[tok] += 1
        out.append(tok)
        seq.append(tok)
    return out


def test_presence_and_frequency_penalties_match_the_openai_formula(tiny: TinyModel) -> None:
    # A repetitive prompt so that plain greedy repeats itself and the penalties bite.
    prompt = tiny.prompt(6, seed=41) * 4
    n = 14
    cases = [(0.0, 1.5), (1.5, 0.0), (0.7, 0.9), (-1.0, 0.0)]
    reqs = [
        _req(
            f"p{i}",
            prompt,
            max_tokens=n,
            temperature=0.0,
            presence_penalty=pres,
            frequency_penalty=freq,
        )
        for i, (pres, freq) in enumerate(cases)
    ]
    reqs.append(_req("plain", prompt, max_tokens=n, temperature=0.0))
    res = run_all(tiny.engine(max_num_batched_tokens=256), reqs)  # all in one batch
    plain = res["plain"].tokens
    differs = 0
    for i, (pres, freq) in enumerate(cases):
        want = _reference_penalised_greedy(tiny, prompt, n, pres, freq)
        assert res[f"p{i}"].tokens == want, (pres, freq)
        differs += want != plain
    assert differs >= 2  # the penalties changed the outputs: the check is not vacuous
