"""vLLM cache blocks ↔ Omni-Flow pages (no vLLM needed): each format's tensors are built
element by element from the index formulas of the layouts vLLM 0.32 uses (decoded against
transformers' K/V, docs/vllm.md), so the page code is checked against the layout, not
against itself."""

from __future__ import annotations

import pytest
import torch

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow_services.worker.vllm.events import BlockNames
from omniflow_services.worker.vllm.pages import BlockFormat, cpu_format

L, H, D, B, S = 2, 2, 32, 32, 16  # layers, kv heads, head dim, vLLM block, page


def kv_values(blocks: int) -> torch.Tensor:
    """Distinct values: [2, layers, blocks, heads, tokens, dim] as float32."""
    n = 2 * L * blocks * H * B * D
    return torch.arange(n, dtype=torch.float32).reshape(2, L, blocks, H, B, D)


def amx_offset(kv: int, t: int, d: int) -> int:
    if kv == 0:  # K [B/16, D/2, 16, 2]
        return (t // 16) * (D // 2 * 32) + (d // 2) * 32 + (t % 16) * 2 + d % 2
    # V [D/16, B/2, 16, 2], after the block's K
    return B * D + (d // 16) * (B // 2 * 32) + (t // 2) * 32 + (d % 16) * 2 + t % 2


def vec_offset(kv: int, t: int, d: int) -> int:
    return d * B + t if kv == 0 else B * D + t * D + d  # K [D, B], V [B, D]


def cpu_caches(values: torch.Tensor, offset) -> list[torch.Tensor]:
    blocks = values.shape[2]
    out = []
    for layer in range(L):
        flat = torch.zeros(blocks, H, 2 * B * D)
        for kv in range(2):
            for t in range(B):
                for d in range(D):
                    flat[:, :, offset(kv, t, d)] = values[kv, layer, :, :, t, d]
        out.append(flat.reshape(blocks, H, B, 2 * D))
    return out


def nhd_caches(values: torch.Tensor) -> list[torch.Tensor]:
    # [2, blocks, tokens, heads, dim] per layer
    return [values[:, layer].permute(0, 1, 3, 2, 4).contiguous() for layer in range(L)]


def expected_page(values: torch.Tensor, block: int, j: int) -> torch.Tensor:
    """Contract order (2, layers, heads, 16, dim) of page j of ``block``."""
    return values[:, :, block, :, j * S : (j + 1) * S, :]


@pytest.mark.parametrize("fmt", ["cpu-amx", "cpu-vec", "nhd"])
def test_pages_hold_their_own_tokens_in_contract_order(fmt: str) -> None:
    values = kv_values(5)
    if fmt == "nhd":
        caches = nhd_caches(values)
    else:
        caches = cpu_caches(values, amx_offset if fmt == "cpu-amx" else vec_offset)
    f = BlockFormat(fmt, L, H, D, B, S, torch.float32)
    f.check(caches)
    pages = f.extract(caches, [3, 1])
    assert pages.shape == (4, f.page_bytes)
    for row, (block, j) in enumerate([(3, 0), (3, 1), (1, 0), (1, 1)]):
        got = pages[row].view(torch.float32).reshape(2, L, H, S, D)
        assert torch.equal(got, expected_page(values, block, j)), (fmt, block, j)

    fresh = [torch.zeros_like(c) for c in caches]
    f.inject(fresh, [0, 4], pages)
    for c, new in zip(caches, fresh, strict=True):
        axis = 1 if fmt == "nhd" else 0
        assert torch.equal(new.select(axis, 0), c.select(axis, 3))
        assert torch.equal(new.select(axis, 4), c.select(axis, 1))
        assert not new.select(axis, 2).any()


def test_opaque_blocks_round_trip_whole() -> None:
    caches = [torch.randn(4, H, B, 2 * D) for _ in range(L)]
    f = BlockFormat("opaque", L, H, D, B, B, torch.float32)
    pages = f.extract(caches, [2])
    assert pages.shape == (1, f.page_bytes)
    fresh = [torch.zeros_like(c) for c in caches]
    f.inject(fresh, [1], pages)
    assert all(torch.equal(n[1], c[2]) for n, c in zip(fresh, caches, strict=True))


def test_bad_shapes_and_formats_are_refused() -> None:
    f = BlockFormat("cpu-amx", L, H, D, B, S, torch.bfloat16)
    with pytest.raises(InvalidArgument, match="do not fit"):
        f.check([torch.zeros(3, H + 1, B, 2 * D, dtype=torch.bfloat16)] * L)
    with pytest.raises(InvalidArgument, match="layers"):
        f.check([torch.zeros(3, H, B, 2 * D, dtype=torch.bfloat16)])
    with pytest.raises(InvalidArgument, match="multiple"):
        BlockFormat("nhd", L, H, D, 24, S, torch.bfloat16)
    with pytest.raises(InvalidArgument, match="accepted"):
        BlockFormat("hnd", L, H, D, B, S, torch.bfloat16)


def test_cpu_format_of_an_isa() -> None:
    assert cpu_format("amx", 32, 16) == "cpu-amx"
    assert cpu_format("vec", 32, 16) == "cpu-vec"
    assert cpu_format("vec", 64, 16) == "opaque"  # not decoded at other block sizes
    assert cpu_format("neon", 32, 16) == "opaque"


def test_vllm_blocks_are_named_by_the_block_hashes_of_their_pages() -> None:
    layout = KVLayout("m", L, H, D, "bfloat16", S)
    names = BlockNames(layout)
    first, second = list(range(100, 164)), list(range(500, 532))
    got = names.stored(None, [b"a", b"b"], first, B)
    assert got == block_hashes(layout.namespace, first, S)  # 2 vLLM blocks, 4 pages
    more = names.stored(b"b", [b"c"], second, B)
    assert more == block_hashes(layout.namespace, first + second, S)[4:]
    assert names.stored(b"unseen", [b"d"], second, B) == []  # its chain cannot be named
    assert names.removed([b"a", b"zz"]) == got[:2]
    assert sorted(names.held()) == sorted(got[2:] + more)
    assert sorted(names.cleared()) == sorted(got[2:] + more) and names.held() == []
