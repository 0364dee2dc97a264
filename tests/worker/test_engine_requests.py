"""Bad input, sampling controls, stop conditions, abort and the async stream."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, run_all

from omniflow.errors import InvalidArgument
from omniflow.models import make_tiny
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest, SamplingParams

VOCAB = 320


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen2", tmp_path_factory.mktemp("tiny"), vocab=VOCAB, max_position=128)


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return Engine(model_dir, EngineConfig(num_pages=32))


def req(rid: str = "r", prompt: list[int] | None = None, **params: object) -> GenerateRequest:
    ids = (5, 6, 7, 8) if prompt is None else tuple(prompt)
    return GenerateRequest(rid, ids, params=SamplingParams(**params))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (GenerateRequest("e", ()), "empty"),
        (GenerateRequest("e", None, prompt=""), "empty"),
        (req(prompt=[1, VOCAB]), f"[0, {VOCAB})"),
        (req(prompt=[-1]), f"[0, {VOCAB})"),
        (req(temperature=-0.5), "temperature must be in [0, 100]"),
        (req(top_p=0.0), "top_p must be in (0, 1]"),
        (req(top_k=VOCAB + 1), f"top_k must be in [0, {VOCAB}]"),
        (req(min_p=1.5), "min_p must be in [0, 1]"),
        (req(repetition_penalty=0.0), "repetition_penalty must be in (0, 10]"),
        (req(max_tokens=0), "max_tokens must be >= 1"),
        (req(stop_token_ids=(VOCAB + 3,)), f"[0, {VOCAB})"),
        (req(prompt=[5] * 128), "context length is 128"),
        (req(prompt=[5] * 100, max_tokens=129), "greater than the context length 128"),
    ],
)
def test_bad_input_names_the_limit(engine: Engine, request_: GenerateRequest, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        engine.add_request(request_)
    assert needle in str(info.value)
    # The engine keeps serving others.
    res = run_all(engine, [req("ok", max_tokens=3, temperature=0.0)])
    assert len(res["ok"].tokens) == 3


def test_request_needing_more_pages_than_the_pool_is_rejected(model_dir: Path) -> None:
    small = Engine(model_dir, EngineConfig(num_pages=2, page_size=16))
    with pytest.raises(InvalidArgument, match="pool has 2"):
        small.add_request(req(prompt=[5] * 30, max_tokens=10))


def test_duplicate_request_id_is_rejected(engine: Engine) -> None:
    engine.add_request(req("same"))
    with pytest.raises(InvalidArgument, match="already running"):
        engine.add_request(req("same"))


def test_seeded_sampling_is_reproducible(model_dir: Path) -> None:
    params = {"temperature": 1.3, "top_k": 50, "top_p": 0.9, "min_p": 0.01, "max_tokens": 12}
    runs = []
    for _ in range(2):
        eng = Engine(model_dir, EngineConfig(num_pages=32))
        r = run_all(eng, [req("a", seed=7, ignore_eos=True, **params)])  # type: ignore[arg-type]
        runs.append(r["a"].tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 12
    eng = Engine(model_dir, EngineConfig(num_pages=32))
    others = [
        run_all(eng, [req(f"s{s}", seed=s, ignore_eos=True, **params)])[f"s{s}"].tokens  # type: ignore[arg-type]
        for s in range(8, 12)
    ]
    assert any(o != runs[0] for o in others)


def test_top_k_one_equals_greedy(engine: Engine) -> None:
    prompt = list(range(10, 40))
    a = run_all(engine, [req("a", prompt, temperature=0.0, max_tokens=8, ignore_eos=True)])
    b = run_all(engine, [req("b", prompt, temperature=5.0, top_k=1, max_tokens=8, ignore_eos=True)])
    assert a["a"].tokens == b["b"].tokens


def test_stop_token_and_max_tokens(engine: Engine) -> None:
    prompt = list(range(60, 80))
    free = run_all(engine, [req("a", prompt, temperature=0.0, max_tokens=10, ignore_eos=True)])
    toks = free["a"].tokens
    assert free["a"].final.finish_reason == "length" and len(toks) == 10
    stop_at = toks[4]
    cut = run_all(
        engine,
        [
            req(
                "b",
                prompt,
                temperature=0.0,
                max_tokens=10,
                ignore_eos=True,
                stop_token_ids=(stop_at,),
            )
        ],
    )
    assert cut["b"].final.finish_reason == "stop"
    assert cut["b"].tokens == toks[: toks.index(stop_at) + 1]


def test_stop_string_cuts_text(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.").ids
    free = run_all(engine, [req("a", prompt, temperature=0.0, max_tokens=24, ignore_eos=True)])
    text = "".join(o.text_delta for o in free["a"].outputs)
    assert len(text) >= 6
    stop = text[3:5]
    cut = run_all(
        engine,
        [req("b", prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))],
    )
    cut_text = "".join(o.text_delta for o in cut["b"].outputs)
    assert cut["b"].final.finish_reason == "stop"
    assert cut_text == text[: text.index(stop)]


def test_abort_frees_pages(engine: Engine) -> None:
    total = engine.load().free_pages
    engine.add_request(req("long", list(range(10, 60)), max_tokens=60, ignore_eos=True))
    engine.add_request(req("short", list(range(5, 9)), max_tokens=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.load().free_pages < total
    assert engine.abort("long")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "long"]
    assert aborted and aborted[0].finish_reason == "abort"
    assert not engine.abort("long")
    while engine.has_unfinished():
        engine.step()
    assert engine.load().free_pages == total and engine.load().running == 0


async def test_generate_streams_and_close_aborts(engine: Engine) -> None:
    pieces = [
        o async for o in engine.generate(req("g", temperature=0.0, max_tokens=5, ignore_eos=True))
    ]
    assert [len(p.new_token_ids) for p in pieces] == [1] * 5
    assert pieces[-1].finished and pieces[-1].usage.generated_tokens == 5

    async def take_two() -> None:
        stream = engine.generate(req("h", max_tokens=50, ignore_eos=True))
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                break
        await stream.aclose()

    async def run_other() -> list[int]:
        r = [o async for o in engine.generate(req("k", temperature=0.0, max_tokens=4))]
        return [t for o in r for t in o.new_token_ids]

    _, other = await asyncio.gather(take_two(), run_other())
    assert 1 <= len(other) <= 4
    for _ in range(100):
        if not engine.has_unfinished():
            break
        await asyncio.sleep(0.01)
    assert not engine.has_unfinished()
    assert engine.load().free_pages == engine.pool.num_pages


def test_bfloat16_engine_runs_and_tracks_float32(model_dir: Path) -> None:
    prompt = list(range(20, 52))
    f32 = run_all(Engine(model_dir, EngineConfig(num_pages=32)), [greedy("a", prompt, 1)])["a"]
    bf = Engine(model_dir, EngineConfig(num_pages=32, dtype="bfloat16"))
    assert bf.pool.data.dtype == torch.bfloat16
    b16 = run_all(bf, [greedy("a", prompt, 1)])["a"]
    assert f32.logits is not None and b16.logits is not None
    diff = (f32.logits - b16.logits).abs().max().item()
    assert diff < 0.15 * f32.logits.abs().max().item()
