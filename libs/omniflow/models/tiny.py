"""Write a random-initialised Llama- or Qwen2-family decoder in the Hugging Face format.

The folder holds ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``), ``generation_config.json``, ``tokenizer.json`` (a
byte-level BPE trained on ``corpus.txt`` shipped next to this module) and a minimal
``tokenizer_config.json``. The same loader that reads a downloaded model reads these.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

ARCHS = ("llama", "qwen2")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS_PATH = Path(__file__).with_name("corpus.txt")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS_PATH)], trainer)
    return tok


def _init_weights(
    arch: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    tie: bool,
    seed: int,
    dtype: str,
) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations O(1) so logits are spread (no near-ties in argmax).
        return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    w: dict[str, torch.Tensor] = {}
    # Small embeddings: with tied weights, logits = norm(h) . E stay O(1) and the layers,
    # not the residual copy of the input token, decide the next token.
    w["model.embed_tokens.weight"] = 0.25 * torch.randn(vocab, hidden, generator=gen)
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(heads * head_dim, generator=gen)
            w[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(kv_heads * head_dim, generator=gen)
            w[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(kv_heads * head_dim, generator=gen)
        w[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
    w["model.norm.weight"] = norm(hidden)
    if not tie:
        w["lm_head.weight"] = 0.25 * torch.randn(vocab, hidden, generator=gen)
    target = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return {k: v.to(target).contiguous() for k, v in w.items()}


def _save_weights(weights: dict[str, Any], out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: weights[k] for k in part}, str(out / fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += weights[k].numel() * weights[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny(
    arch: str,
    out_dir: str | Path,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int | None = None,
    max_position: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_embeddings: bool | None = None,
    dtype: str = "float32",
    seed: int = 0,
    shards: int = 1,
) -> Path:
    """Write a random-initialised ``arch`` model to ``out_dir`` and return the folder.

    ``vocab`` is the embedding size; the trained tokenizer uses at most that many ids.
    ``tie_embeddings`` defaults to True for qwen2 and False for llama (as their small
    real checkpoints do). ``shards`` > 1 writes a sharded checkpoint with an index.
    """
    if arch not in ARCHS:
        raise InvalidArgument(f"arch {arch!r} is not supported; accepted: {list(ARCHS)}")
    if layers < 1 or hidden < 8 or heads < 1 or kv_heads < 1:
        raise InvalidArgument("layers, heads and kv_heads must be >= 1 and hidden >= 8")
    if hidden % heads or heads % kv_heads:
        raise InvalidArgument(
            f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    head_dim = hidden // heads
    if head_dim % 2:
        raise InvalidArgument(f"head_dim = hidden/heads must be even, got {head_dim}")
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab < min_vocab:
        raise InvalidArgument(f"vocab must be >= {min_vocab} (bytes + special tokens), got {vocab}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise InvalidArgument(f"dtype {dtype!r} not accepted; accepted: float32, bfloat16, float16")
    if intermediate is None:
        intermediate = 64 * math.ceil(hidden * 8 / 3 / 64)
    tie = (arch == "qwen2") if tie_embeddings is None else tie_embeddings

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": tie,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen_cfg = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_position,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))

    weights = _init_weights(
        arch, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tie, seed, dtype
    )
    _save_weights(weights, out, shards)
    log.info("wrote tiny %s model (%d layers, hidden %d) to %s", arch, layers, hidden, out)
    return out
