"""Write a GGUF file the way llama.cpp's converter lays one out, from a tiny HF folder, so the
converter can be checked on Qwen2 files (none ships in a wheel) and on the Q/K permutation
against ground truth. Only the file is written here; transformers reads it as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_NAMES[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(folder: Path, out: Path, pre: str, quantize: bool = True) -> Path:
    """``folder`` (a Llama/Qwen2 HF model with a byte-level BPE tokenizer.json) as a GGUF
    file: 2-D weights Q8_0 when ``quantize`` (norms and biases stay F32)."""
    import gguf
    from gguf.quants import quantize as q
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    tokens += [f"[PAD{i}]" for i in range(cfg["vocab_size"] - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])

    weights: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, arr in sorted(weights.items()):
        arr = arr.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            arr = _permute(arr, heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = _permute(arr, kv_heads)
        if quantize and arr.ndim == 2 and arr.shape[1] % 32 == 0:
            w.add_tensor(_gguf_name(name), q(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(_gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
