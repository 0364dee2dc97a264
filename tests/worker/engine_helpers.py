"""Helpers of the engine tests: tiny models, their transformers twins, a run-to-end loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from omniflow.models import make_tiny
from omniflow_services.worker.engine import (
    Engine,
    EngineConfig,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
)

ATOL = 1e-4


@dataclass
class Result:
    tokens: list[int]
    logits: torch.Tensor | None
    outputs: list[RequestOutput]

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


def run_all(engine: Engine, requests: list[GenerateRequest]) -> dict[str, Result]:
    """Add every request at once and step the engine until all finish."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id].append(o)
    else:
        raise AssertionError("engine did not finish")
    res = {}
    for rid, lst in outs.items():
        toks = [t for o in lst for t in o.new_token_ids]
        rows = [o.logits for o in lst if o.logits is not None]
        res[rid] = Result(toks, torch.cat(rows) if rows else None, lst)
    return res


def greedy(rid: str, prompt: list[int], n: int, logits: bool = True) -> GenerateRequest:
    return GenerateRequest(
        rid,
        tuple(prompt),
        params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        return_logits=logits,
    )


@dataclass
class TinyModel:
    path: Path
    hf: torch.nn.Module
    vocab: int

    def engine(self, connector: object = None, **kw: object) -> Engine:
        kw.setdefault("num_pages", 128)
        return Engine(self.path, EngineConfig(**kw), connector=connector)  # type: ignore[arg-type]

    def prompt(self, n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, self.vocab, (n,), generator=g).tolist()

    @torch.no_grad()
    def check(self, prompt: list[int], result: Result) -> None:
        """Logits at every sampled position and the greedy tokens equal transformers'."""
        n = len(result.tokens)
        assert n > 0
        seq = torch.tensor([prompt + result.tokens[:-1]])
        ref = self.hf(seq).logits[0, len(prompt) - 1 :].float()
        assert result.logits is not None and result.logits.shape == ref.shape
        torch.testing.assert_close(result.logits, ref, atol=ATOL, rtol=0)
        gen = self.hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
        assert gen[0, len(prompt) :].tolist() == result.tokens


def load_hf(path: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Random weights hit EOS early; both sides generate the full length instead.
    model.generation_config.eos_token_id = None
    return model.eval()


MakeTiny = Callable[..., TinyModel]


def make_tiny_model(out: Path, arch: str, **kw: object) -> TinyModel:
    kw.setdefault("vocab", 384)
    path = make_tiny(arch, out, **kw)  # type: ignore[arg-type]
    return TinyModel(path, load_hf(path), int(kw["vocab"]))  # type: ignore[call-overload]
