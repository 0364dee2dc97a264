"""/tokenize and /detokenize (vLLM's shapes) against transformers' tokenizer and chat
template on the same SmolLM2 folder; /version; GET /v1/models/{id} through the ``openai``
client; /openapi.json valid by openapi-spec-validator and listing the real request
bodies; /docs; and the guard on each (the key on all but those two, open as in vLLM)."""

from __future__ import annotations

from importlib import metadata

import httpx
import pytest
from endpoints_topology import LLM, MINILM, WHISPER, Endpoints

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a KV cache?"},
]


@pytest.fixture(scope="module")
def hf_tok(endpoints: Endpoints):
    transformers = pytest.importorskip("transformers", reason="the reference tokenizer")
    return transformers.AutoTokenizer.from_pretrained(str(endpoints.llm_dir))


@pytest.fixture(scope="module")
def http(endpoints: Endpoints):
    auth = {"Authorization": f"Bearer {endpoints.api_key}"}
    with httpx.Client(base_url=endpoints.url, headers=auth, timeout=60) as c:
        yield c


def test_tokenize_prompt_equals_transformers(http, hf_tok) -> None:
    text = "Hello there, KV caches!"
    r = http.post("/tokenize", json={"model": LLM, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_tok(text)["input_ids"]
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["token_strs"] == hf_tok.convert_ids_to_tokens(want)
    assert body["max_model_len"] == 8192  # SmolLM2's max_position_embeddings
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] is None  # model left out: the one llm model served


def test_tokenize_chat_equals_apply_chat_template(http, hf_tok) -> None:
    r = http.post("/tokenize", json={"model": LLM, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    want = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert r.json()["tokens"] == list(want)
    no_prompt = http.post(
        "/tokenize", json={"model": LLM, "messages": MESSAGES, "add_generation_prompt": False}
    ).json()["tokens"]
    want = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert no_prompt == list(want)
    both = http.post(
        "/tokenize",
        json={
            "model": LLM,
            "messages": MESSAGES,
            "add_generation_prompt": True,
            "continue_final_message": True,
        },
    )
    assert both.status_code == 400 and "continue_final_message" in both.text
    reserved = http.post(
        "/tokenize",
        json={"model": LLM, "messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
    )
    assert reserved.json()["error"]["param"] == "chat_template_kwargs.messages"
    # continue_final_message: the last (assistant) message is continued, as transformers does
    prefill = [*MESSAGES, {"role": "assistant", "content": "A KV cache"}]
    cont = http.post(
        "/tokenize",
        json={"model": LLM, "messages": prefill, "continue_final_message": True},
    ).json()["tokens"]
    want = hf_tok.apply_chat_template(prefill, continue_final_message=True, tokenize=True)
    assert cont == list(want["input_ids"] if hasattr(want, "keys") else want)


def test_detokenize_equals_decode(http, hf_tok) -> None:
    ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = http.post("/detokenize", json={"model": LLM, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf_tok.decode(ids)}
    bad = http.post("/detokenize", json={"model": LLM, "tokens": [1, 10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = http.post("/detokenize", json={"model": "nope", "tokens": [1]})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_version(http) -> None:
    assert http.get("/version").json() == {"version": metadata.version("omniflow")}


def test_model_by_id(client) -> None:
    import openai

    for name, owner in ((LLM, "omniflow:llm"), (MINILM, "omniflow:embed")):
        card = client.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (name, "model", owner)
    assert client.models.retrieve(WHISPER).owned_by == "omniflow:encoder"
    with pytest.raises(openai.NotFoundError) as nf:
        client.models.retrieve("no-such-model")
    err = nf.value.body
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["param"] == "model" and "no-such-model" in err["message"]


def test_openapi_is_valid_and_lists_the_request_shapes(http) -> None:
    validator = pytest.importorskip("openapi_spec_validator", reason="the schema's reference")
    doc = http.get("/openapi.json").json()
    validator.validate(doc)
    paths = doc["paths"]
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/audio/speech",
        "/v1/images/generations",
        "/tokenize",
        "/detokenize",
    ):
        assert "requestBody" in paths[path]["post"], path
    schemas = doc["components"]["schemas"]
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"model", "messages"} <= set(schemas["ChatCompletionRequest"]["required"])
    audio = paths["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]
    form = schemas["TranscriptionRequest"]["properties"]
    assert "multipart/form-data" in audio and form["file"]["format"] == "binary"
    tok = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(tok["oneOf"]) == 2
    assert {"/version", "/v1/models", "/v1/models/{model_id}"} <= set(paths)


def test_docs_page(http) -> None:
    r = http.get("/docs")
    assert r.status_code == 200 and "swagger-ui" in r.text and "/openapi.json" in r.text


def test_guard_on_every_new_route(endpoints: Endpoints) -> None:
    with httpx.Client(base_url=endpoints.url, timeout=30) as anon:
        for method, path in (
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/version"),
            ("POST", "/v1/embeddings"),
            ("POST", "/v1/audio/translations"),
        ):
            r = anon.request(method, path, json={})
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
        # The API's description is open, as vLLM's server leaves it: no key, a wrong key.
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            doc = anon.get("/openapi.json", headers=headers)
            assert doc.status_code == 200, doc.text
            assert "/v1/embeddings" in doc.json()["paths"]
            page = anon.get("/docs", headers=headers)
            assert page.status_code == 200 and "swagger-ui" in page.text
