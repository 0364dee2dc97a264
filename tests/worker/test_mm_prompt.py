"""Multimodal prompts in the engine: block identity through image spans, and logits with the
image span reused from the prefix cache equal to a full recompute (and to transformers)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import ATOL, TinyModel, run_all

from omniflow.chat import ChatTemplate
from omniflow.kv.blocks import block_hashes, item_id, pad_id
from omniflow_services.worker.engine import (
    EmbedSpan,
    Engine,
    EngineConfig,
    GenerateRequest,
    SamplingParams,
)
from omniflow_services.worker.mm.prompt import ItemEmbeddings, build_prompt, chat_segments

PAGE = 16
CHATML = ChatTemplate(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _item(raw: bytes, n: int = 20) -> ItemEmbeddings:
    async def fetch() -> torch.Tensor:
        raise AssertionError("not fetched in identity tests")

    return ItemEmbeddings(item_id(raw), n, fetch)


def _prompt(items: list[ItemEmbeddings], text: str = "describe it"):
    loop = asyncio.new_event_loop()
    try:
        segs = chat_segments([("user", [*items, text])], True, CHATML)
        return build_prompt(segs, lambda s: [ord(c) % 200 for c in s], PAGE, loop, 64)
    finally:
        loop.close()


NS = bytes(range(16))


def _hashes(p) -> list[bytes]:
    return block_hashes(NS, p.tokens, PAGE, p.extra_keys)


def test_same_bytes_share_every_page_and_different_images_none_from_their_start() -> None:
    a, b = b"image-a" * 50, b"image-b" * 50
    pa1, pa2, pb = _prompt([_item(a)]), _prompt([_item(a)]), _prompt([_item(b)])
    assert _hashes(pa1) == _hashes(pa2)
    span = pa1.spans[0]
    first_page = span.start // PAGE
    ha, hb = _hashes(pa1), _hashes(pb)
    assert ha[:first_page] == hb[:first_page]
    assert not set(ha[first_page:]) & set(hb[first_page:])
    assert pa1.tokens[span.start : span.start + span.length] == [pad_id(item_id(a))] * span.length


def test_image_starting_mid_page_shares_the_text_pages_before_it() -> None:
    a, b = b"x" * 99, b"y" * 99
    text = "a" * 40  # with "<|im_start|>user\n" (17 one-char tokens): 57 before the image
    loop = asyncio.new_event_loop()
    try:
        mk = lambda raw: build_prompt(  # noqa: E731
            chat_segments([("user", [text, _item(raw), "end"])], True, CHATML),
            lambda s: [ord(c) % 200 for c in s], PAGE, loop, 64,
        )  # fmt: skip
        pa, pb = mk(a), mk(b)
    finally:
        loop.close()
    ha, hb = _hashes(pa), _hashes(pb)
    assert pa.spans[0].start == 57
    assert ha[:3] == hb[:3]  # pages 0-2 are text only
    assert not set(ha[3:]) & set(hb[3:])  # page 3 holds text and the image: not shared


def test_single_pixel_changes_the_item_id() -> None:
    pytest.importorskip("PIL")
    import io

    import numpy as np
    from PIL import Image

    arr = np.zeros((16, 16, 3), np.uint8)
    buf1, buf2 = io.BytesIO(), io.BytesIO()
    Image.fromarray(arr).save(buf1, "PNG")
    arr[7, 9, 2] = 1
    Image.fromarray(arr).save(buf2, "PNG")
    assert item_id(buf1.getvalue()) != item_id(buf2.getvalue())
    assert item_id(buf1.getvalue()) == item_id(bytes(buf1.getvalue()))


# --- engine: embeddings at pad positions -----------------------------------------------------


def _mm_request(
    rid: str, emb: torch.Tensor, raw: bytes, calls: list[str], prefix: list[int], suffix: list[int]
) -> GenerateRequest:
    n = emb.shape[0]
    pid = pad_id(item_id(raw))
    tokens = [*prefix, *([pid] * n), *suffix]
    from omniflow.kv.blocks import MultimodalSpan, apply_multimodal

    toks, extra = apply_multimodal(tokens, [MultimodalSpan(item_id(raw), len(prefix), n)], PAGE)

    def load() -> torch.Tensor:
        calls.append(rid)
        return emb

    return GenerateRequest(
        rid,
        prompt_token_ids=toks,
        params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        extra_keys=extra,
        embeds=(EmbedSpan(len(prefix), n, load),),
        return_logits=True,
    )


def test_logits_with_the_image_span_reused_equal_a_full_recompute(tiny: TinyModel) -> None:
    gen = torch.Generator().manual_seed(0)
    emb = 0.3 * torch.randn(37, 64, generator=gen)  # spans pages 0-2, ends mid page
    raw = b"picture bytes"
    prefix, suffix = [5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    calls: list[str] = []
    cached = Engine(tiny.path, EngineConfig(num_pages=64, max_num_batched_tokens=24))
    run_all(cached, [_mm_request("t1", emb, raw, calls, prefix, suffix)])
    turn2 = run_all(cached, [_mm_request("t2", emb, raw, calls, prefix, [*suffix, 21, 22])])["t2"]
    # The span ends at 40 < 48: pages 0-2 come from the cache, no embedding fetched again.
    assert turn2.final.usage.cached_tokens == 48
    assert calls == ["t1", "t1"]  # chunked prefill (24 tokens a step) asked twice in turn 1
    fresh = Engine(tiny.path, EngineConfig(num_pages=64, enable_prefix_cache=False))
    ref = run_all(fresh, [_mm_request("r", emb, raw, [], prefix, [*suffix, 21, 22])])["r"]
    assert ref.final.usage.cached_tokens == 0
    assert turn2.tokens == ref.tokens
    torch.testing.assert_close(turn2.logits, ref.logits, atol=ATOL, rtol=0)

    # The anchor: transformers with the same input embeddings.
    prompt = [*prefix, *([0] * 37), *suffix, 21, 22]
    with torch.no_grad():
        x = tiny.hf.get_input_embeddings()(torch.tensor([prompt + ref.tokens[:-1]]))
        x[0, 3:40] = emb
        hf = tiny.hf(inputs_embeds=x).logits[0, len(prompt) - 1 :].float()
    torch.testing.assert_close(ref.logits, hf, atol=ATOL, rtol=0)


def test_embeddings_matter_and_bad_spans_are_rejected(tiny: TinyModel) -> None:
    from omniflow.errors import InvalidArgument

    engine = Engine(tiny.path, EngineConfig(num_pages=64))
    g = torch.Generator().manual_seed(1)
    e1, e2 = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    r1 = run_all(engine, [_mm_request("a", e1, b"one", [], [1, 2], [3, 4])])["a"]
    r2 = run_all(engine, [_mm_request("b", e2, b"two", [], [1, 2], [3, 4])])["b"]
    assert not torch.allclose(r1.logits[0], r2.logits[0])
    pid = pad_id(item_id(b"z"))
    with pytest.raises(InvalidArgument, match="no media embeddings"):
        engine.add_request(GenerateRequest("c", prompt_token_ids=[1, pid, 2]))
    with pytest.raises(InvalidArgument, match="shape"):
        engine.add_request(
            GenerateRequest(
                "d",
                prompt_token_ids=[1, pid, 2],
                embeds=(EmbedSpan(1, 1, torch.zeros(1, 32)),),
            )
        )
    with pytest.raises(InvalidArgument, match="outside"):
        engine.add_request(
            GenerateRequest(
                "e", prompt_token_ids=[1, pid, 2], embeds=(EmbedSpan(2, 5, torch.zeros(5, 64)),)
            )
        )


def test_a_failing_embedding_fetch_drops_only_that_request(tiny: TinyModel) -> None:
    engine = Engine(tiny.path, EngineConfig(num_pages=64))

    def broken() -> torch.Tensor:
        raise ConnectionError("agent gone")

    pid = pad_id(item_id(b"q"))
    bad = GenerateRequest(
        "bad", prompt_token_ids=[1, pid, pid, 2], embeds=(EmbedSpan(1, 2, broken),)
    )
    good = GenerateRequest("good", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))
    res = run_all(engine, [bad, good])
    assert res["bad"].final.finish_reason == "abort"
    assert isinstance(res["bad"].final.error, ConnectionError)
    assert len(res["good"].tokens) == 2


def test_return_kv_gives_the_prompt_kv(tiny: TinyModel) -> None:
    engine = Engine(tiny.path, EngineConfig(num_pages=64, max_num_batched_tokens=16))
    prompt = list(range(1, 40))
    req = GenerateRequest("k", prompt_token_ids=prompt, params=SamplingParams(1), return_kv=True)
    out = run_all(engine, [req])["k"].outputs[0]
    assert out.kv is not None
    k, v = out.kv
    assert k.shape == (2, 2, 39, 16) and v.shape == k.shape
    with torch.no_grad():
        past = tiny.hf(torch.tensor([prompt]), use_cache=True).past_key_values
    hf_k = past.layers[0].keys[0] if hasattr(past, "layers") else past[0][0][0]
    torch.testing.assert_close(k[0], hf_k.float(), atol=ATOL, rtol=0)
