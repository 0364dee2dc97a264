"""``convert_gguf`` against transformers' own GGUF loader: same token ids, same chat template,
same logits; and the built-in engine on the converted folder equals transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from smol_helpers import Smol, run_to_end

from omniflow.errors import InvalidArgument
from omniflow.models.gguf_convert import convert_gguf, hf_tensor_name, unpermute_rows

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  two leading spaces,\n\nblank lines\tand a tab   ",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά",
    "numbers 2024 and 3.14159 and 1,000,000",
    "it's, we'll, they're; CamelCase snake_case kebab-case",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "def f(x):\n    return x ** 2  # square\n",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


def _ours(smol: Smol):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smol.converted)


def test_folder_is_a_complete_hf_model(smol: Smol) -> None:
    config = json.loads((smol.converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-05
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((smol.converted / "generation_config.json").read_text())["eos_token_id"] == [
        2
    ]
    tok_cfg = json.loads((smol.converted / "tokenizer_config.json").read_text())
    assert tok_cfg["add_bos_token"] is False
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert (smol.converted / "chat_template.jinja").read_text() == tok_cfg["chat_template"]


def test_token_ids_equal_transformers(smol: Smol, ref_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ours = _ours(smol)
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref_tokenizer(text)["input_ids"], text
        ids = ours(text)["input_ids"]
        assert ours.decode(ids) == ref_tokenizer.decode(ids) == text
    assert ours.all_special_tokens == ref_tokenizer.all_special_tokens
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        ref_tokenizer.bos_token,
        ref_tokenizer.eos_token,
        ref_tokenizer.pad_token,
        ref_tokenizer.unk_token,
    )


def test_chat_template_equals_transformers(smol: Smol, ref_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ours = _ours(smol)
    assert ours.chat_template == ref_tokenizer.chat_template
    assert "You are a helpful AI assistant named SmolLM" in ours.chat_template
    for msgs in MESSAGES:
        a = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        b = ref_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert a == b


@torch.no_grad()
def test_logits_equal_transformers_gguf_loader(smol: Smol, ref_model, ref_tokenizer) -> None:  # type: ignore[no-untyped-def]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(smol.converted, dtype=torch.float32)
    ids = ref_tokenizer.apply_chat_template(
        MESSAGES[1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, atol=1e-4, rtol=0)


def test_engine_equals_transformers_on_a_chat_prompt(smol: Smol, ref_model, ref_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from omniflow_services.worker.engine import (
        Engine,
        EngineConfig,
        GenerateRequest,
        SamplingParams,
    )

    prompt = ref_tokenizer.apply_chat_template(
        MESSAGES[0], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    engine = Engine(smol.converted, EngineConfig(num_pages=32, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    tokens, rows = run_to_end(
        engine, GenerateRequest("a", tuple(prompt), params=params, return_logits=True)
    )
    ref = ref_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )[0, len(prompt) :].tolist()
    assert tokens == ref
    assert tokens[-1] == 2  # stopped at <|im_end|>, the file's eos
    assert "Paris" in ref_tokenizer.decode(tokens)
    with torch.no_grad():
        seq = torch.tensor([prompt + tokens[:-1]])
        logits = ref_model(seq).logits[0, len(prompt) - 1 :]
    assert rows is not None
    torch.testing.assert_close(rows, logits, atol=1e-4, rtol=0)


def test_cli_converts_to_bfloat16(smol: Smol, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "bf16"
    proc = subprocess.run(
        [sys.executable, "-m", "omniflow.cli.main", "models", "convert-gguf", str(smol.gguf),
         str(out), "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert "dequantized 272/272 tensors" in proc.stderr  # progress on long work
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
        assert "lm_head.weight" not in f.keys()  # tied
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]  # no temporary folder left

    bad = subprocess.run(
        [sys.executable, "-m", "omniflow.cli.main", "models", "convert-gguf",
         str(tmp_path / "none.gguf"), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert script: per head, the two rotary halves are interleaved.
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rows(permuted.numpy(), heads), w.numpy())


def test_clear_errors(smol: Smol, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(InvalidArgument, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")
    with pytest.raises(InvalidArgument, match="accepted"):
        convert_gguf(smol.gguf, tmp_path / "out", dtype="int8")
    with pytest.raises(InvalidArgument, match="no Llama/Qwen2 counterpart"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidArgument, match="'mamba' is not supported; accepted"):
        convert_gguf(path, tmp_path / "out")
