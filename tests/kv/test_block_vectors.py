"""The published block-hash test vectors of docs/kv-block-hash.md, and the multimodal helper."""

from __future__ import annotations

import pytest
import xxhash

from omniflow.kv.blocks import (
    BlockIdentityError,
    KVLayout,
    MultimodalSpan,
    apply_multimodal,
    block_hashes,
    item_id,
    pad_id,
)

L1 = KVLayout("omniflow/test-vector", 2, 2, 8, "float16", 4)
L2 = KVLayout("meta-llama/Llama-3.2-1B", 16, 8, 64, "bfloat16", 16)
A = item_id(b"omniflow test image A")
B = item_id(b"omniflow test audio B")


def hexes(hashes: list[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def test_namespaces_and_items() -> None:
    assert L1.fingerprint() == (
        b"omniflow-kv-v1|model=omniflow/test-vector|layers=2|kv_heads=2|head_dim=8"
        b"|dtype=float16|page=4|lora="
    )
    assert L1.namespace_hex == "f49e3b120ff3bfb787027e8491864612"
    assert L2.namespace_hex == "0008fd7a83f47924dddc5e5a32481788"
    assert A.hex() == "80bb56b3fdaa31b98c7fc577076d2e50"
    assert B.hex() == "7730119a1ae40ce9881f744c19b05603"
    assert pad_id(A) == 0xB356BB80
    assert pad_id(B) == 0x9A113077


def test_v1_matches_spec_bytes_computed_by_hand() -> None:
    got = block_hashes(L1.namespace, list(range(10)), 4)
    assert hexes(got) == ["020a4c9d17423c3595ad14fe623f8912", "bf3fafe4e31b06866c6764d52236fa5a"]
    # The same from the raw byte layout, independently of block_hashes.
    parent = bytes(16)
    for i, expected in enumerate(got):
        toks = b"".join(t.to_bytes(4, "little") for t in range(i * 4, i * 4 + 4))
        parent = xxhash.xxh3_128_digest(parent + L1.namespace + toks)
        assert parent == expected


def test_v2() -> None:
    got = block_hashes(L2.namespace, [128000, *range(1000, 1039)], 16)
    assert hexes(got) == ["a0065e650e75e19d3b347a2afaf319b5", "89c38af7780dd9ef122e8f5f42bee15b"]


def test_v3_one_item_over_two_pages() -> None:
    tokens, extra = apply_multimodal(
        [100, 101, 0, 0, 0, 0, 0, 0, 102, 103, 104, 105], [MultimodalSpan(A, 2, 6)], 4
    )
    assert tokens[2:8] == [pad_id(A)] * 6 and tokens[:2] == [100, 101]
    assert extra == {0: A + bytes(4), 1: A + (2).to_bytes(4, "little")}
    assert hexes(block_hashes(L1.namespace, tokens, 4, extra)) == [
        "4b7205f75ed004c5044d085e13f7248b",
        "a24f8b12a4df70c2776f0c4941377ddb",
        "69ecf85679b10dba3ad52687b53c308c",
    ]


def test_v4_two_items_share_a_page() -> None:
    tokens, extra = apply_multimodal(
        [7, 0, 0, 0, 0, 0, 8, 9, 10], [MultimodalSpan(B, 3, 3), MultimodalSpan(A, 1, 2)], 4
    )
    assert extra == {0: A + bytes(4) + B + bytes(4), 1: B + (1).to_bytes(4, "little")}
    assert hexes(block_hashes(L1.namespace, tokens, 4, extra)) == [
        "6901cdc95d5b8f671d3ae31b06d662fb",
        "4770a1eccbcc9b798eff5f68263be4a4",
    ]


def test_same_image_shares_pages_different_image_does_not() -> None:
    other = item_id(b"another image")
    base = [1, 2, 0, 0, 0, 0, 0, 0, 3, 4, 5, 6]
    t1, e1 = apply_multimodal(base, [MultimodalSpan(A, 2, 6)], 4)
    t2, e2 = apply_multimodal(list(base), [MultimodalSpan(A, 2, 6)], 4)
    t3, e3 = apply_multimodal(base, [MultimodalSpan(other, 2, 6)], 4)
    h1, h2, h3 = (block_hashes(L1.namespace, t, 4, e) for t, e in ((t1, e1), (t2, e2), (t3, e3)))
    assert h1 == h2
    assert not set(h1) & set(h3)


@pytest.mark.parametrize(
    "spans",
    [
        [MultimodalSpan(A, 10, 4)],  # past the end
        [MultimodalSpan(A, 0, 0)],  # empty
        [MultimodalSpan(A, 0, 4), MultimodalSpan(B, 3, 2)],  # overlapping
        [MultimodalSpan(b"short", 0, 2)],  # bad id
    ],
)
def test_bad_spans_rejected(spans: list[MultimodalSpan]) -> None:
    with pytest.raises(BlockIdentityError):
        apply_multimodal(list(range(12)), spans, 4)
