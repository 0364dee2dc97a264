"""The device KV pool: one tensor of pages the engine allocates itself.

Shape ``[num_pages, 2, num_layers, num_kv_heads, page_size, head_dim]``: one page is a
contiguous block in exactly the byte order of a page on the wire (K then V, layer-major,
then head, token, dim; native little-endian elements of ``KVLayout.dtype``), so export and
import are a single copy. Per-layer K and V are strided views of the same storage.
"""

from __future__ import annotations

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
        self.data = torch.zeros(
            num_pages,
            2,
            layout.num_layers,
            layout.num_kv_heads,
            layout.page_size,
            layout.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._layers = [(self.data[:, 0, i], self.data[:, 1, i]) for i in range(layout.num_layers)]

    @staticmethod
    def pages_for_bytes(layout: KVLayout, budget_bytes: int) -> int:
        """How many pages fit in ``budget_bytes`` (at least one)."""
        return max(1, budget_bytes // layout.page_bytes)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer, each ``[num_pages, kv_heads, page_size, head_dim]``."""
        return self._layers[index]

    def export_pages(self, pages: list[int]) -> list[bytes]:
        """Raw bytes of each page, in the KVLayout byte order."""
        if not pages:
            return []
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        host = self.data.index_select(0, idx).cpu().contiguous()
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
        if not pages:
            return
        raw = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        tensor = raw.view(self.dtype).reshape((len(pages), *self.data.shape[1:]))
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        self.data.index_copy_(0, idx, tensor.to(self.device))
