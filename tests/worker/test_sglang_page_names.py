"""SGLang's page keys named by the chain: the worker records key → block hash as tokens
arrive (``PageNames``), the HiCache backend in SGLang's scheduler process reads them
(``KeyTable``, ``KeyMapper``). Without SGLang: the keys are ``sglang_page_keys`` (checked
against sha256 in test_sglang_backend.py, against SGLang's own ``get_hash_str`` on a GPU in
tests/gpu/sglang_e2e.py) and the names the library's ``block_hashes``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow_services.worker.sglang.pages import (
    KeyMapper,
    KeyTable,
    PageNames,
    sglang_page_keys,
)

NS = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=8).namespace
TOKENS = [(37 * i + 11) % 30000 for i in range(16 * 5 + 3)]  # 5 full pages and a tail


def test_names_are_the_chains_block_hashes_under_sglangs_keys(tmp_path: Path) -> None:
    path = tmp_path / "t.keys"
    writer = KeyTable(path, namespace=NS, slots=256)
    names = PageNames(writer, 16)
    # The prompt, then generated tokens arriving a few at a time: each page named once.
    assert names.extend(TOKENS[:40]) == 2
    assert names.extend(TOKENS[:47]) == 0
    assert names.extend(TOKENS) == 3
    keys = sglang_page_keys(TOKENS, 16)
    chain = block_hashes(NS, TOKENS, 16)
    reader = KeyTable(path)  # a mapping of its own, as SGLang's scheduler process opens it
    try:
        assert reader.namespace == NS and reader.slots == 256
        assert [reader.get(bytes.fromhex(k)) for k in keys] == chain
        assert KeyMapper(NS, reader).block_hashes(keys) == chain
        # Without the table the same keys keep their key-derived names, never the chain's.
        plain = KeyMapper(NS).block_hashes(keys)
        assert set(plain).isdisjoint(chain)
        # A key nobody recorded (another sequence) falls back to that name too.
        other = sglang_page_keys([5] * 16, 16)
        assert KeyMapper(NS, reader).block_hashes(other) == KeyMapper(NS).block_hashes(other)
        # Keys that are not SGLang's sha256 hex (xxh3 mode, junk) never reach the table.
        assert KeyMapper(NS, reader).block_hash("z" * 64) == KeyMapper(NS).block_hash("z" * 64)
    finally:
        reader.close()
        writer.close(unlink=True)
    assert not path.exists()


def test_a_reader_in_another_process_sees_what_the_worker_wrote(tmp_path: Path) -> None:
    path = tmp_path / "t.keys"
    writer = KeyTable(path, namespace=NS, slots=64)
    try:
        PageNames(writer, 16).extend(TOKENS)
        keys = sglang_page_keys(TOKENS, 16)
        code = (
            "import json, sys\n"
            "from omniflow_services.worker.sglang.pages import KeyTable\n"
            "t = KeyTable(sys.argv[1])\n"
            "got = [t.get(bytes.fromhex(k)) for k in json.loads(sys.argv[2])]\n"
            "print(json.dumps([g.hex() if g else None for g in got]))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(path), json.dumps(keys)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(out.stdout) == [h.hex() for h in block_hashes(NS, TOKENS, 16)]
    finally:
        writer.close(unlink=True)


def test_an_overwritten_or_torn_slot_is_a_miss(tmp_path: Path) -> None:
    table = KeyTable(tmp_path / "t.keys", namespace=NS, slots=1)  # every key in one slot
    try:
        a, b = bytes(range(32)), bytes(range(1, 33))
        table.put(a, b"A" * 16)
        assert table.get(a) == b"A" * 16
        table.put(b, b"B" * 16)
        assert table.get(a) is None and table.get(b) == b"B" * 16
        table._map[-9] ^= 0xFF  # a byte of the hash changed under the reader
        assert table.get(b) is None
        key = "07" * 32
        assert KeyMapper(NS, table).block_hash(key) == KeyMapper(NS).block_hash(key)
    finally:
        table.close()


def test_a_file_that_is_not_a_key_table_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.keys"
    bad.write_bytes(b"x" * 100)
    with pytest.raises(InvalidArgument, match="not an SGLang key table"):
        KeyTable(bad)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        KeyTable(tmp_path / "n.keys", namespace=b"short")
