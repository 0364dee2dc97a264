"""Convert a Llama- or Qwen2-family GGUF file (llama.cpp's format) into a Hugging Face folder.

The folder is what a hub download holds: ``config.json``, ``model.safetensors`` (weights
dequantized to float32 or bfloat16), ``tokenizer.json`` + ``tokenizer_config.json`` (with the
file's chat template, also written as ``chat_template.jinja``), ``special_tokens_map.json``
and ``generation_config.json``. Reading uses gguf-py (``GGUFReader``, ``gguf.quants``).

llama.cpp permutes the rows of Llama's Q and K projections so that rotary pairs sit next to
each other (GGML's rope layout); Hugging Face's Llama keeps them half a head apart, so those
rows are permuted back here. Qwen2 files are written unpermuted.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omniflow.errors import InvalidArgument
from omniflow.models.gguf_tokenizer import GGUFTokenizer, build_tokenizer, tokenizer_config

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
OUT_DTYPES = ("float32", "bfloat16")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def _quiet(_: str) -> None:
    return None


def _f32(value: Any) -> float:
    """A GGUF float32 as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of the file as plain Python values."""
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = field.contents()
    return meta


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` →
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if m := _BLOCK_RE.match(name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise InvalidArgument(
        f"GGUF tensor {name!r} has no Llama/Qwen2 counterpart; accepted: token_embd, "
        f"output_norm, output, blk.N.{{{', '.join(_BLOCK_NAMES)}}}"
    )


def unpermute_rows(w: Any, heads: int) -> Any:
    """Undo llama.cpp's Q/K row order: per head, interleaved rotary pairs → two halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(arch: str, meta: dict[str, Any], names: set[str], dtype: str) -> dict[str, Any]:
    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if "rope_freqs.weight" in names:
        raise InvalidArgument(
            "GGUF file carries rope_freqs (Llama-3.1-style rope scaling), which this converter "
            "does not support; accepted: files without per-frequency rope factors"
        )
    scaling_type = key("rope.scaling.type", "none")
    rope_scaling: dict[str, Any] | None = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise InvalidArgument(
            f"{arch}.rope.scaling.type {scaling_type!r} is not supported; accepted: none, linear"
        )
    config: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length") or key("rope.dimension_count") or 0)
        or hidden // heads,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": "output.weight" not in names,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = config["num_hidden_layers"]
    for name, field in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{field}" in meta:
            config[name] = int(meta[f"tokenizer.ggml.{field}"])
    return config


def _weights(reader: Any, config: dict[str, Any], dtype: str, progress: Progress) -> dict[str, Any]:
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permute = config["model_type"] == "llama"
    out: dict[str, Any] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = hf_tensor_name(t.name)
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            arr = dequantize(t.data, qtype)
        except NotImplementedError as exc:
            raise InvalidArgument(
                f"GGUF tensor {t.name!r} uses quant type {qtype.name}, which gguf-py cannot "
                f"dequantize; accepted: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0 and the K-quants"
            ) from exc
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dim first
        arr = arr.reshape(shape)
        if permute and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = unpermute_rows(arr, heads)
        elif permute and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = unpermute_rows(arr, kv_heads)
        out[name] = torch.from_numpy(arr.copy()).to(getattr(torch, dtype))
        if (i + 1) % 32 == 0 or i + 1 == total:
            progress(f"dequantized {i + 1}/{total} tensors")
    if config["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out


def convert_gguf(
    src: str | Path,
    out: str | Path,
    dtype: str = "float32",
    progress: Progress = _quiet,
) -> Path:
    """Write the Hugging Face folder for GGUF file ``src`` at ``out`` (created or replaced).

    Raises InvalidArgument for an architecture, tokenizer, rope scaling or quant type it
    cannot convert, naming what it found and what is accepted.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    if dtype not in OUT_DTYPES:
        raise InvalidArgument(f"dtype {dtype!r} not accepted; accepted: {list(OUT_DTYPES)}")
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise InvalidArgument(f"GGUF file {src} does not exist")
    progress(f"reading {src}")
    try:
        reader = GGUFReader(str(src))
    except (ValueError, OSError) as exc:
        raise InvalidArgument(f"{src} is not a readable GGUF file: {exc}") from exc
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise InvalidArgument(
            f"GGUF architecture {arch!r} is not supported; accepted: {sorted(ARCHS)}"
        )
    names = {t.name for t in reader.tensors}
    config = _config(arch, meta, names, dtype)
    tok_info = GGUFTokenizer.from_metadata(meta)

    out.mkdir(parents=True, exist_ok=True)
    progress(f"building tokenizer ({len(tok_info.tokens)} tokens, pre={tok_info.pre})")
    build_tokenizer(tok_info).save(str(out / "tokenizer.json"))
    tok_cfg = tokenizer_config(tok_info, config["max_position_embeddings"])
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    specials = tok_info.special_tokens()
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    if tok_info.chat_template:
        (out / "chat_template.jinja").write_text(tok_info.chat_template)

    weights = _weights(reader, config, dtype, progress)
    progress(f"writing {out / 'model.safetensors'}")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "pad_token_id") if k in config}
    if "eos_token_id" in config:
        gen["eos_token_id"] = [config["eos_token_id"]]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    progress(f"wrote {out}")
    return out


def convert_gguf_atomic(
    src: str | Path, out: str | Path, dtype: str = "float32", progress: Progress = _quiet
) -> Path:
    """``convert_gguf`` into a temporary sibling of ``out``, renamed into place when complete."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.converting")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(src, tmp, dtype=dtype, progress=progress)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
