"""make_tiny writes a folder that both the engine loader and transformers read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from omniflow.errors import InvalidArgument
from omniflow.models import make_tiny
from omniflow.models.cli import main


def test_cli_writes_a_sharded_llama(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    argv = [
        "make-tiny",
        "--arch",
        "llama",
        "--layers",
        "3",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "1",
        "--vocab",
        "300",
        "--shards",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["num_key_value_heads"] == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() <= 300
    text = "Hello, world! <|im_start|>user"
    enc = tok.encode(text)
    assert tok.token_to_id("<|im_start|>") in enc.ids
    assert tok.decode(enc.ids, skip_special_tokens=False) == text


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = make_tiny("qwen2", tmp_path / "a", seed=3)
    b = make_tiny("qwen2", tmp_path / "b", seed=3)
    c = make_tiny("qwen2", tmp_path / "c", seed=4)
    data = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert data[0] == data[1] != data[2]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"arch": "gpt2"}, "accepted: ['llama', 'qwen2']"),
        ({"hidden": 60, "heads": 8}, "must divide"),
        ({"vocab": 100}, "vocab must be >= 259"),
    ],
)
def test_bad_arguments(tmp_path: Path, kw: dict, needle: str) -> None:
    kw.setdefault("arch", "llama")
    with pytest.raises(InvalidArgument) as info:
        make_tiny(out_dir=tmp_path, **kw)
    assert needle in str(info.value)
