"""Small factories shared by the Data Flow tests: a layout, chains of hashes, page bytes."""

from __future__ import annotations

import numpy as np

from omniflow.kv.blocks import KVLayout, block_hashes

# 2 layers x 2 heads x 16 dim x fp32 x 16 tokens x (K, V) = 8 KiB pages
LAYOUT = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)


def chain(n: int, seed: int = 0, layout: KVLayout = LAYOUT) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 32000, n * layout.page_size).tolist()
    return block_hashes(layout.namespace, tokens, layout.page_size)


def pages(n: int, seed: int = 0, layout: KVLayout = LAYOUT) -> list[bytes]:
    rng = np.random.default_rng(1000 + seed)
    return [rng.integers(0, 256, layout.page_bytes, dtype=np.uint8).tobytes() for _ in range(n)]
