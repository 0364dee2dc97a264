"""vLLM KV blocks ↔ Omni-Flow pages (pure torch: no vLLM, no gRPC).

A vLLM block holds ``block_size`` tokens of one layer; an Omni-Flow page holds
``page_size`` tokens of every layer, in the contract order ``(2 [K, V], layers, kv_heads,
page_size, head_dim)`` (``KVLayout.page_shape``). vLLM's block size must be a multiple of
the page size (vLLM CPU accepts only multiples of 32, so one block is two 16-token pages);
a block is loaded only when all its pages are.

Per-layer cache tensors vLLM hands the connector (``register_kv_caches``):

=========== ======================================= ======================================
format      tensor of one layer                     where
=========== ======================================= ======================================
``cpu``     ``[blocks, heads, block, 2 * head_dim]`` CPU_ATTN (vLLM CPU): per block and
            viewed ``[blocks, heads, 2, block, dim]`` head, ``block`` K rows then V rows
``nhd``     ``[2, blocks, block, heads, head_dim]`` FlashAttention / FlashInfer (GPU)
=========== ======================================= ======================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout

FORMATS = ("cpu", "nhd")


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """How one vLLM worker's KV cache is laid out, and the pages it maps to."""

    format: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    page_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InvalidArgument(f"KV format {self.format!r} is not accepted; accepted: {FORMATS}")
        if self.page_size <= 0 or self.block_size % self.page_size:
            raise InvalidArgument(
                f"vLLM block_size {self.block_size} must be a multiple of page_size "
                f"{self.page_size}"
            )

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_size

    @property
    def page_bytes(self) -> int:
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * self.page_size * self.dtype.itemsize

    @classmethod
    def detect(
        cls, caches: Sequence[torch.Tensor], layout: KVLayout, block_size: int
    ) -> BlockFormat:
        """The format of vLLM's per-layer ``caches``, checked against ``layout``."""
        if len(caches) != layout.num_layers:
            raise InvalidArgument(
                f"vLLM has {len(caches)} KV cache layers; the namespace layout has "
                f"{layout.num_layers}"
            )
        t = caches[0]
        h, d, b = layout.num_kv_heads, layout.head_dim, block_size
        if t.dim() == 4 and tuple(t.shape[1:]) == (h, b, 2 * d):
            fmt = "cpu"
        elif t.dim() == 5 and t.shape[0] == 2 and tuple(t.shape[2:]) == (b, h, d):
            fmt = "nhd"
        else:
            raise InvalidArgument(
                f"vLLM KV cache tensors of shape {tuple(t.shape)} are not a known layout "
                f"(heads {h}, head_dim {d}, block {b}); accepted: [blocks, heads, block, "
                "2*head_dim] (CPU) or [2, blocks, block, heads, head_dim] (GPU, NHD)"
            )
        for i, c in enumerate(caches):
            if c.shape != t.shape or c.dtype != t.dtype:
                raise InvalidArgument(f"KV cache layer {i} differs from layer 0 in shape/dtype")
        return cls(fmt, layout.num_layers, h, d, b, layout.page_size, t.dtype)

    def _blocks(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[n, 2, heads, pages_per_block, page_size, dim] view-or-copy of some blocks."""
        n, p, s = block_ids.numel(), self.pages_per_block, self.page_size
        h, d = self.num_kv_heads, self.head_dim
        if self.format == "cpu":
            sel = cache.index_select(0, block_ids).view(n, h, 2, p, s, d)
            return sel.permute(0, 2, 1, 3, 4, 5)
        sel = cache.index_select(1, block_ids).view(2, n, p, s, h, d)
        return sel.permute(1, 0, 4, 2, 3, 5)

    def extract(self, caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
        """Pages of whole blocks, ``[len(block_ids) * pages_per_block, page_bytes]`` uint8 on
        the CPU, in block order then page order within a block."""
        device = caches[0].device
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        # [layers, n, 2, heads, pages, tokens, dim] -> [n, pages, 2, layers, heads, tokens, dim]
        stacked = torch.stack([self._blocks(c, ids) for c in caches])
        pages = stacked.permute(1, 4, 2, 0, 3, 5, 6).contiguous()
        flat = pages.reshape(len(ids) * self.pages_per_block, -1)
        return flat.cpu().view(torch.uint8)

    def inject(
        self, caches: Sequence[torch.Tensor], block_ids: Sequence[int], pages: torch.Tensor
    ) -> None:
        """Write ``pages`` (``extract``'s shape and order, any device) into the blocks."""
        n, p = len(block_ids), self.pages_per_block
        if pages.shape[0] != n * p:
            raise InvalidArgument(f"{pages.shape[0]} pages for {n} blocks of {p} pages each")
        device = caches[0].device
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        h, d, s, layers = self.num_kv_heads, self.head_dim, self.page_size, self.num_layers
        data = pages.to(device).reshape(n, p, -1).view(self.dtype)
        data = data.reshape(n, p, 2, layers, h, s, d)
        for layer, cache in enumerate(caches):
            src = data[:, :, :, layer]  # [n, pages, 2, heads, tokens, dim]
            if self.format == "cpu":  # -> [n, heads, 2, pages, tokens, dim]
                blocks = src.permute(0, 3, 2, 1, 4, 5).reshape(n, *cache.shape[1:])
                cache.index_copy_(0, ids, blocks)
            else:  # -> [2, n, pages, tokens, heads, dim]
                blocks = src.permute(2, 0, 1, 4, 3, 5).reshape(2, n, *cache.shape[2:])
                cache.index_copy_(1, ids, blocks)
