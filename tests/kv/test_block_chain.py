"""The one chain helper (``extend_chain``): pinned to the hashes the index, the arena and
every test already hold, and an incremental extension equal to the one-shot chain."""

from __future__ import annotations

import pytest
import xxhash

from omniflow.kv.blocks import (
    ROOT_PARENT,
    BlockIdentityError,
    KVLayout,
    block_hashes,
    encode_extra_keys,
    extend_chain,
    item_id,
)

NS = KVLayout("omniflow/chain-pin", 3, 2, 8, "float16", 4).namespace
TOKENS = [(i * 7919 + 13) % 50000 for i in range(200)]
A, B = item_id(b"pin image"), item_id(b"pin audio")
EXTRAS: dict[str, dict[int, bytes] | None] = {
    "none": None,
    "p4x": {0: encode_extra_keys([(A, 0)]), 3: encode_extra_keys([(A, 8), (B, 0)]), 40: b"salt"},
    "p16x": {1: encode_extra_keys([(B, 5)]), 11: b"tenant-salt"},
}
# xxh3_128 of the concatenated chain, recorded from ``block_hashes`` before the helper
# existed (commit dd02963): the chain must never change under the index and the arena.
PINNED = [
    (1, "none", 200, "886b455bc3e7f44fd13bb1bf45884e65"),
    (4, "none", 50, "8f07270693fe7d2451546ff92f95aac3"),
    (16, "none", 12, "4827744d550e60f6cf544b60adfde811"),
    (64, "none", 3, "d13cca44020cb3394969ce6d19ff5c02"),
    (4, "p4x", 50, "befbcd582c3e0edf69a2469e144a40c6"),
    (16, "p16x", 12, "b4cfa673d1713dc02e3f8a97c0da786f"),
]


def by_hand(ns: bytes, tokens: list[int], size: int, extra: dict[int, bytes] | None) -> list[bytes]:
    """DESIGN §4.1 from the raw bytes, with xxhash alone."""
    out, parent = [], bytes(16)
    for i in range(len(tokens) // size):
        raw = b"".join(t.to_bytes(4, "little") for t in tokens[i * size : (i + 1) * size])
        parent = xxhash.xxh3_128_digest(parent + ns + raw + (extra or {}).get(i, b""))
        out.append(parent)
    return out


@pytest.mark.parametrize(("size", "extra", "count", "digest"), PINNED)
def test_chain_is_pinned(size: int, extra: str, count: int, digest: str) -> None:
    one_shot = block_hashes(NS, TOKENS, size, EXTRAS[extra])
    chain: list[bytes] = []
    assert extend_chain(chain, NS, TOKENS, size, EXTRAS[extra]) == chain
    assert chain == one_shot == by_hand(NS, TOKENS, size, EXTRAS[extra])
    assert len(chain) == count
    assert xxhash.xxh3_128_hexdigest(b"".join(chain)) == digest


@pytest.mark.parametrize(("size", "extra"), [(1, "none"), (4, "p4x"), (16, "p16x"), (7, "none")])
def test_incremental_equals_one_shot(size: int, extra: str) -> None:
    ex = EXTRAS[extra]
    chain: list[bytes] = []
    # Tokens arrive a few at a time, as a decoding sequence's do; each page hashed once.
    for n in sorted({0, 1, 3, size - 1, size, size + 2, 5 * size + 1, 90, 133, 199, 200}):
        before = list(chain)
        new = extend_chain(chain, NS, TOKENS[:n], size, ex)
        assert chain[: len(before)] == before
        assert chain == before + new == block_hashes(NS, TOKENS[:n], size, ex)
    # A capped extension stops at ``pages``; a later call goes on from there.
    capped: list[bytes] = []
    assert extend_chain(capped, NS, TOKENS, size, ex, pages=3) == chain[:3]
    assert extend_chain(capped, NS, TOKENS, size, ex, pages=2) == []
    assert extend_chain(capped, NS, TOKENS, size, ex) == chain[3:]
    assert capped == chain


def test_parent_continues_a_chain() -> None:
    whole = block_hashes(NS, TOKENS, 4)
    # A block whose parent hash is known (vLLM's events name blocks so) continues the chain.
    tail = extend_chain([], NS, TOKENS[40:], 4, parent=whole[9])
    assert tail == whole[10:]
    assert block_hashes(NS, TOKENS[40:], 4, parent=whole[9]) == whole[10:]
    assert extend_chain([], NS, TOKENS[:8], 4, parent=ROOT_PARENT) == whole[:2]


def test_bad_input() -> None:
    with pytest.raises(BlockIdentityError, match="page_size"):
        extend_chain([], NS, TOKENS, 0)
    with pytest.raises(BlockIdentityError, match="namespace"):
        extend_chain([], NS.hex().encode(), TOKENS, 4)
    with pytest.raises(BlockIdentityError, match="unsigned 32-bit"):
        extend_chain([], NS, [1, 2, 3, -1], 4)
    assert extend_chain([], NS, TOKENS[:3], 4) == []  # the partial tail page has no hash


def test_sglang_keys_map_by_the_chains_page_hash() -> None:
    # SGLang hands its storage backend only its own page keys: each maps to the first page
    # of a chain in the namespace that holds no tokens and carries the key as extra key.
    from omniflow_services.worker.sglang.pages import KEY_DOMAIN, KeyMapper, sglang_page_keys

    keys = sglang_page_keys(TOKENS[:64], 16)
    mapper = KeyMapper(NS)
    for key in keys:
        want = xxhash.xxh3_128_digest(bytes(16) + NS + KEY_DOMAIN + key.encode())
        assert mapper.block_hash(key) == want
    assert mapper.prompt_hashes(TOKENS[:64], 16) == mapper.block_hashes(keys)
