"""/v1/embeddings through the official ``openai`` client against sentence-transformers'
``encode`` on the same all-MiniLM-L6-v2 folder (cosine >= 0.9999), in both encodings, for
strings and token ids, with usage, OpenAI's errors and the guard."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from endpoints_topology import MINILM, Endpoints

TEXTS = [
    "A man is eating food.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "émojis 🙂 and punctuation?!",
    "one",
]


@pytest.fixture(scope="module")
def reference(endpoints: Endpoints):
    st = pytest.importorskip("sentence_transformers", reason="the reference is ST's encode")
    return st.SentenceTransformer(str(endpoints.minilm_dir), device="cpu")


def _cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def test_strings_equal_sentence_transformers(client, reference) -> None:
    want = reference.encode(TEXTS)
    for fmt in ("float", "base64"):
        resp = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format=fmt)
        assert resp.model == MINILM and resp.object == "list"
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        if fmt == "base64":  # asked for explicitly, the client hands the text back as is
            got = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in resp.data])
        else:
            got = np.array([d.embedding for d in resp.data])
        assert got.shape == (len(TEXTS), 384)
        assert _cosines(got, want).min() >= 0.9999, fmt
        # Normalised, as the folder's Normalize module says.
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert resp.usage.prompt_tokens == tokens == resp.usage.total_tokens


def test_default_encoding_is_what_the_client_decodes(client, reference, endpoints) -> None:
    """The client asks for base64 by default and decodes it; the raw reply is float32 LE."""
    one = client.embeddings.create(model=MINILM, input=TEXTS[0])
    assert _cosines(np.array([one.data[0].embedding]), reference.encode(TEXTS[:1]))[0] >= 0.9999
    raw = httpx.post(
        endpoints.base_url + "/embeddings",
        json={"model": MINILM, "input": TEXTS[0], "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {endpoints.api_key}"},
        timeout=60,
    ).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, one.data[0].embedding, atol=1e-7)


def test_token_ids_as_given(client, reference) -> None:
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    want = reference.encode(TEXTS[:3])
    many = client.embeddings.create(model=MINILM, input=ids, encoding_format="float")
    assert _cosines(np.array([d.embedding for d in many.data]), want).min() >= 0.9999
    assert many.usage.prompt_tokens == sum(len(x) for x in ids)
    one = client.embeddings.create(model=MINILM, input=ids[1], encoding_format="float")
    assert _cosines(np.array([one.data[0].embedding]), want[1:2])[0] >= 0.9999


def test_concurrent_requests_batched_each_answer_its_own(client, reference) -> None:
    want = reference.encode(TEXTS)

    def one(i: int) -> list[float]:
        text = TEXTS[i % len(TEXTS)]
        return client.embeddings.create(model=MINILM, input=text).data[0].embedding

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(16)))
    cos = _cosines(np.array(got), np.array([want[i % len(TEXTS)] for i in range(16)]))
    assert cos.min() >= 0.9999


def test_errors_are_openais(client, endpoints) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model=MINILM, input="x", dimensions=128)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.embeddings.create(model=MINILM, input="word " * 300)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model=MINILM, input=[])
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.embeddings.create(model=MINILM, input=[[101, 10**6, 102]])
    with pytest.raises(openai.NotFoundError) as nf:
        client.embeddings.create(model="no-such-model", input="x")
    assert nf.value.body["param"] == "model" and "served: all-minilm-l6-v2" in str(nf.value)
    with pytest.raises(openai.BadRequestError, match="truncate is not supported"):
        client.embeddings.create(model=MINILM, input="x", extra_body={"truncate": 3})
    listed = {m.id: m.owned_by for m in client.models.list()}
    assert listed[MINILM] == "omniflow:embed"


def test_guard_applies(endpoints: Endpoints) -> None:
    url = endpoints.base_url + "/embeddings"
    body = {"model": MINILM, "input": "x"}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    big = {"model": MINILM, "input": "x" * (endpoints.max_body + 1)}
    auth = {"Authorization": f"Bearer {endpoints.api_key}"}
    r = httpx.post(url, json=big, headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
