"""The device KV pool: one tensor of pages the engine allocates itself.

Storage is ``[2, num_layers, num_kv_heads, num_pages, page_size, head_dim]`` (head-major):
gathering a request's pages for one layer yields ``[heads, pages, page_size, dim]``, which
is already the ``[heads, tokens, dim]`` shape attention wants, with no second copy.

A page on the wire (export/import) is in the byte order of ``KVLayout.page_shape``,
``[2 (K, V), num_layers, num_kv_heads, page_size, head_dim]`` of native little-endian
``KVLayout.dtype`` elements; export converts with one gather, import copies each page once
from the received buffer into the pool.
"""

from __future__ import annotations

import warnings

import torch

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVPool:
    """Paged K/V storage for every layer; page ids are indices into the first dimension."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str) -> None:
        if layout.dtype not in TORCH_DTYPES:
            raise InvalidArgument(
                f"KV dtype {layout.dtype!r} not accepted; accepted: {sorted(TORCH_DTYPES)}"
            )
        self.layout = layout
        self.num_pages = num_pages
        self.dtype = TORCH_DTYPES[layout.dtype]
        self.device = torch.device(device)
        # empty + zero_ touches every page now, not on the first request (no lazy faults).
        # Zeros matter: masked attention still multiplies unused slots by 0 (NaN would leak).
        self.data = torch.empty(
            2,
            layout.num_layers,
            layout.num_kv_heads,
            num_pages,
            layout.page_size,
            layout.head_dim,
            dtype=self.dtype,
            device=self.device,
        ).zero_()
        self._layers = [(self.data[0, i], self.data[1, i]) for i in range(layout.num_layers)]

    @staticmethod
    def pages_for_bytes(layout: KVLayout, budget_bytes: int) -> int:
        """How many pages fit in ``budget_bytes`` (at least one)."""
        return max(1, budget_bytes // layout.page_bytes)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each contiguous ``[kv_heads, num_pages, page_size, head_dim]``."""
        return self._layers[index]

    def export_pages(self, pages: list[int]) -> list[bytes]:
        """Raw bytes of each page, in the KVLayout byte order."""
        if not pages:
            return []
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        # [2, L, H, n, P, D] -> [n, 2, L, H, P, D]
        host = self.data.index_select(3, idx).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()
        flat = host.view(torch.uint8).reshape(len(pages), -1).numpy()
        return [flat[i].tobytes() for i in range(len(pages))]

    def import_pages(self, pages: list[int], blobs: list[bytes]) -> None:
        """Write raw page bytes (as produced by ``export_pages``) into ``pages``."""
        if len(pages) != len(blobs):
            raise InvalidArgument(f"{len(pages)} pages but {len(blobs)} blobs")
        want = self.layout.page_bytes
        for b in blobs:
            if len(b) != want:
                raise InvalidArgument(f"page blob has {len(b)} bytes; the layout needs {want}")
        shape = self.layout.page_shape
        with warnings.catch_warnings():
            # frombuffer warns that bytes are read-only; they are only read here.
            warnings.simplefilter("ignore", UserWarning)
            for page, blob in zip(pages, blobs, strict=True):
                # One copy per page, straight from the received buffer into the pool.
                src = torch.frombuffer(blob, dtype=torch.uint8).view(self.dtype).view(shape)
                self.data[:, :, :, page].copy_(src)
