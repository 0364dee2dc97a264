"""KVPool page bytes follow the KVLayout order [K|V, layer, head, token, dim]."""

from __future__ import annotations

import pytest
import torch

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout
from omniflow_services.worker.engine.kv_pool import KVPool


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_order_and_import_round_trip(dtype: str) -> None:
    layout = KVLayout("m", num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
    pool = KVPool(layout, num_pages=5, device="cpu")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    (blob,) = pool.export_pages([3])
    assert len(blob) == layout.page_bytes
    expected = torch.stack(
        [torch.stack([pool.layer(i)[kv][:, 3] for i in range(3)]) for kv in (0, 1)]
    )  # [2, L, H, P, D]
    assert tuple(expected.shape) == layout.page_shape
    got = torch.frombuffer(bytearray(blob), dtype=pool.dtype).reshape(layout.page_shape)
    assert torch.equal(got, expected)

    other = KVPool(layout, num_pages=2, device="cpu")
    other.import_pages([1], [blob])
    for i in range(3):
        for kv in (0, 1):
            assert torch.equal(other.layer(i)[kv][:, 1], pool.layer(i)[kv][:, 3])
            assert not other.layer(i)[kv][:, 0].any()


def test_import_rejects_a_wrong_size() -> None:
    layout = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, page_size=2)
    pool = KVPool(layout, num_pages=1, device="cpu")
    with pytest.raises(InvalidArgument, match=f"needs {layout.page_bytes}"):
        pool.import_pages([0], [b"\x00" * 3])
