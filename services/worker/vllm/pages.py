"""vLLM KV blocks ↔ Omni-Flow pages (pure torch: no vLLM, no gRPC).

A vLLM block holds ``block_size`` tokens of one layer; an Omni-Flow page holds
``page_size`` tokens of every layer, in the contract order ``(2 [K, V], layers, kv_heads,
page_size, head_dim)`` (``KVLayout.page_shape``). vLLM's block size is a multiple of the
page size (vLLM CPU accepts only multiples of 32: one block is two 16-token pages); a block
is loaded only when all its pages are. Each page holds only its own tokens, so a page that
two prompts share is the same bytes for both.

Per-layer cache tensors vLLM hands the connector (``register_kv_caches``), per format:

============ ============================================ =================================
format       one layer's tensor / one block of one head    where (read in vLLM 0.32)
============ ============================================ =================================
``cpu-amx``  ``[blocks, heads, block, 2 * head_dim]``;     CPU_ATTN with the AMX ISA
             K as ``[block/16, head_dim/2, 16, 2]``        (bfloat16, block 32):
             (16-token tiles, dim pairs), then V as        decoded against transformers'
             ``[head_dim/16, block/2, 16, 2]`` (16-dim     K/V (docs/vllm.md)
             tiles, token pairs)
``cpu-vec``  as ``cpu-amx``; K as ``[head_dim, block]``     CPU_ATTN with the vec ISA
             (transposed), then V as ``[block, head_dim]`` (float32, or no AMX), decoded
                                                           the same way
``nhd``      ``[2, blocks, block, heads, head_dim]``       FlashAttention / FlashInfer (GPU)
``opaque``   any ``[blocks, ...]``                         other CPU ISAs: byte layout not
                                                           decoded, so a page is a whole
                                                           block in vLLM's own order
============ ============================================ =================================

``opaque`` pages are a namespace of their own (``opaque_model_id``): the page size
is the block size and the bytes are not in the contract order, so only vLLM workers of the
same ISA share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omniflow.errors import InvalidArgument

FORMATS = ("cpu-amx", "cpu-vec", "nhd", "opaque")
DECODED_CPU_BLOCK = 32  # the block size the CPU layouts were decoded at
AMX_TILE = 16  # tokens of a K tile and dims of a V tile in the AMX layout


def opaque_model_id(model_id: str, block_size: int) -> str:
    """The model id of an ``opaque`` namespace: its pages are vLLM's own block bytes."""
    return f"{model_id}+vllm-opaque-b{block_size}"


def cpu_format(isa: str, block_size: int, page_size: int) -> str:
    """The format of vLLM CPU's cache for its attention ISA (``_get_attn_isa``)."""
    if block_size != DECODED_CPU_BLOCK or page_size != AMX_TILE:
        return "opaque"
    return {"amx": "cpu-amx", "vec": "cpu-vec"}.get(isa, "opaque")


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
        if self.format == "opaque" and self.page_size != self.block_size:
            raise InvalidArgument("an opaque format's page is one whole vLLM block")
        if self.format == "cpu-amx" and (
            self.page_size != AMX_TILE or self.head_dim % AMX_TILE or self.block_size % 32
        ):
            raise InvalidArgument(
                f"the AMX layout needs 16-token pages, head_dim % 16 == 0 and block % 32 == 0; "
                f"got page {self.page_size}, head_dim {self.head_dim}, block {self.block_size}"
            )

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_size

    @property
    def page_bytes(self) -> int:
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * self.page_size * self.dtype.itemsize

    def check(self, caches: Sequence[torch.Tensor]) -> None:
        """InvalidArgument unless ``caches`` are this format's tensors."""
        if len(caches) != self.num_layers:
            raise InvalidArgument(
                f"vLLM has {len(caches)} KV cache layers; the namespace layout has "
                f"{self.num_layers}"
            )
        t = caches[0]
        h, d, b = self.num_kv_heads, self.head_dim, self.block_size
        if self.format == "nhd":
            ok = t.dim() == 5 and t.shape[0] == 2 and tuple(t.shape[2:]) == (b, h, d)
        elif self.format in ("cpu-amx", "cpu-vec"):
            ok = t.dim() == 4 and tuple(t.shape[1:]) == (h, b, 2 * d)
        else:
            ok = t[0].numel() == 2 * h * b * d
        if not ok:
            raise InvalidArgument(
                f"vLLM KV cache tensors of shape {tuple(t.shape)} do not fit the {self.format} "
                f"layout (heads {h}, head_dim {d}, block {b})"
            )
        for i, c in enumerate(caches):
            if c.shape != t.shape or c.dtype != self.dtype:
                raise InvalidArgument(
                    f"KV cache layer {i} is {tuple(c.shape)} {c.dtype}; layer 0 is "
                    f"{tuple(t.shape)} {self.dtype}"
                )

    # --- one layer: blocks <-> [n, 2, heads, pages, tokens, dim] ---------------------------

    def _read(self, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, p, s = ids.numel(), self.pages_per_block, self.page_size
        h, d, b = self.num_kv_heads, self.head_dim, self.block_size
        if self.format == "nhd":
            sel = cache.index_select(1, ids).view(2, n, p, s, h, d)
            return sel.permute(1, 0, 4, 2, 3, 5)
        sel = cache.index_select(0, ids).reshape(n, h, 2, b * d)
        if self.format == "opaque":
            return sel.reshape(n, 1, 1, 1, 1, -1)  # the block's bytes as they are
        if self.format == "cpu-vec":  # K [d, b] (transposed), V [b, d]
            k = sel[:, :, 0].reshape(n, h, d, b).transpose(2, 3).reshape(n, h, p, s, d)
            return torch.stack([k, sel[:, :, 1].reshape(n, h, p, s, d)], dim=1)
        t = AMX_TILE
        # K [b/16, d/2, 16, 2] -> [pages, 16, d]
        k = sel[:, :, 0].reshape(n, h, p, d // 2, t, 2).permute(0, 1, 2, 4, 3, 5)
        # V [d/16, b/2, 16, 2] = (dim tile, token pair, dim, token in pair) -> [pages, 16, d]
        v = sel[:, :, 1].reshape(n, h, d // t, p, t // 2, t, 2).permute(0, 1, 3, 4, 6, 2, 5)
        k = k.reshape(n, h, p, s, d)
        v = v.reshape(n, h, p, s, d)
        return torch.stack([k, v], dim=1)

    def _write(self, cache: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
        """``src``: [n, pages, 2, heads, tokens, dim] (opaque: [n, 1, 1, 1, 1, bytes])."""
        n, p, s = ids.numel(), self.pages_per_block, self.page_size
        h, d, b = self.num_kv_heads, self.head_dim, self.block_size
        if self.format == "nhd":  # -> [2, n, pages, tokens, heads, dim]
            blocks = src.permute(2, 0, 1, 4, 3, 5).reshape(2, n, *cache.shape[2:])
            cache.index_copy_(1, ids, blocks)
            return
        if self.format == "opaque":
            cache.index_copy_(0, ids, src.reshape(n, *cache.shape[1:]))
            return
        k = src[:, :, 0].permute(0, 2, 1, 3, 4)  # [n, heads, pages, tokens, dim]
        v = src[:, :, 1].permute(0, 2, 1, 3, 4)
        if self.format == "cpu-vec":
            k = k.reshape(n, h, b, d).transpose(2, 3).reshape(n, h, b * d)
            blocks = torch.stack([k, v.reshape(n, h, b * d)], dim=2)
            cache.index_copy_(0, ids, blocks.reshape(n, *cache.shape[1:]))
            return
        t = AMX_TILE
        k = k.reshape(n, h, p, s, d // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, h, b * d)
        v = v.reshape(n, h, p, t // 2, 2, d // t, t).permute(0, 1, 5, 2, 3, 6, 4)
        blocks = torch.stack([k, v.reshape(n, h, b * d)], dim=2)
        cache.index_copy_(0, ids, blocks.reshape(n, *cache.shape[1:]))

    # --- every layer: blocks <-> pages -----------------------------------------------------

    def extract(self, caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
        """Pages of whole blocks, ``[len(block_ids) * pages_per_block, page_bytes]`` uint8 on
        the CPU, in block order then page order within a block."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0].device)
        # [layers, n, 2, heads, pages, tokens, dim] -> [n, pages, 2, layers, heads, tokens, dim]
        stacked = torch.stack([self._read(c, ids) for c in caches])
        pages = stacked.permute(1, 4, 2, 0, 3, 5, 6).contiguous()
        flat = pages.reshape(len(block_ids) * self.pages_per_block, -1)
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
        data = pages.to(device).reshape(n * p, -1).view(self.dtype)
        if self.format == "opaque":
            data = data.reshape(n, 1, 1, self.num_layers, 1, 1, -1)
        else:
            shape = (self.num_kv_heads, self.page_size, self.head_dim)
            data = data.reshape(n, p, 2, self.num_layers, *shape)
        for layer, cache in enumerate(caches):
            self._write(cache, ids, data[:, :, :, layer])
