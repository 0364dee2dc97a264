"""TensorRefs: store, map from another process, TTL, budget, checksum, bad input."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from omniflow.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted
from omniflow.kv.checksum import page_checksum
from omniflow_services.kv_agent.tensors import TensorRef, TensorStore, map_tensor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> Iterator[TensorStore]:
    s = TensorStore(f"test-{uuid.uuid4().hex[:8]}", 1 << 20, default_ttl_s=10, clock=clock)
    try:
        yield s
    finally:
        s.close()


def _child_sum(ref: TensorRef, out: mp.Queue) -> None:  # type: ignore[type-arg]
    out.put(float(map_tensor(ref).sum()))


def test_put_view_and_map_from_another_process(store: TensorStore) -> None:
    emb = np.arange(12, dtype=np.float32).reshape(3, 4)
    ref = store.put(emb)
    assert (ref.shape, ref.dtype, ref.nbytes) == ((3, 4), "float32", 48)
    assert ref.checksum == page_checksum(emb.tobytes())
    np.testing.assert_array_equal(store.view(ref.ref_id), emb)
    assert store.read_bytes(ref.ref_id) == emb.tobytes()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child_sum, args=(ref, q))
    proc.start()
    assert q.get(timeout=60) == float(emb.sum())
    proc.join(30)
    assert proc.exitcode == 0


def test_raw_bytes_with_bfloat16(store: TensorStore) -> None:
    ref = store.put(b"\x01\x02" * 6, shape=(2, 3), dtype="bfloat16")
    assert ref.nbytes == 12 and store.view(ref.ref_id).dtype == np.uint8
    with pytest.raises(InvalidArgument, match="shape"):
        store.put(b"\x00" * 5, shape=(2, 3), dtype="bfloat16")
    with pytest.raises(InvalidArgument, match="dtype"):
        store.put(b"\x00" * 4, shape=(4,), dtype="nope")
    with pytest.raises(InvalidArgument, match="explicit"):
        store.put(b"\x00" * 4)


def test_ttl_expiry_and_unknown(store: TensorStore, clock: Clock) -> None:
    ref = store.put(np.ones(8, np.int64), ttl_s=5)
    clock.now += 4
    assert store.lookup(ref.ref_id) == ref
    clock.now += 2
    with pytest.raises(NotFound, match="expired"):
        store.view(ref.ref_id)
    assert store.sweep() == 1 and store.used_bytes == 0
    with pytest.raises(NotFound):
        map_tensor(ref)
    with pytest.raises(NotFound):
        store.lookup("no-such-ref")
    with pytest.raises(InvalidArgument, match="ttl"):
        store.put(np.ones(1), ttl_s=0)


def test_budget_and_checksum(store: TensorStore) -> None:
    big = np.zeros(1 << 19, np.uint8)
    store.put(big)
    ref = store.put(big)
    with pytest.raises(ResourceExhausted, match="does not fit"):
        store.put(np.zeros(1, np.uint8))
    assert store.delete(ref.ref_id) and not store.delete(ref.ref_id)
    with pytest.raises(DataLoss):
        store.put(np.ones(4, np.uint8), checksum=1)
    ok = store.put(np.ones(4, np.uint8), checksum=page_checksum(np.ones(4, np.uint8)))
    assert store.read_bytes(ok.ref_id) == b"\x01" * 4
