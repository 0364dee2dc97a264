"""Typed configuration: the model's ``config.json`` and the engine's own settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniflow.errors import InvalidArgument

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16")
MATMULS = ("auto", "onednn", "aten")
KERNELS = ("auto", "native", "torch")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` that a Llama/Qwen2 decoder needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # The checkpoint's stored dtype (informational: EngineConfig.dtype decides compute).
    checkpoint_dtype: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgument(
                f"model_type {model_type!r} is not supported; "
                f"accepted: {list(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "qwen2" and raw.get("use_sliding_window"):
            raise InvalidArgument("qwen2 use_sliding_window=true is not supported; accepted: false")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # Newer transformers store rope settings under rope_parameters; older ones use
        # rope_theta + rope_scaling. Read both.
        rope_params = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = dict(rope_params)
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise InvalidArgument(
                    f"rope type {rtype!r} is not supported; accepted: {list(SUPPORTED_ROPE_TYPES)}"
                )
            scaling = {**scaling, "rope_type": rtype}
            if rtype == "default":
                scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            # transformers 5 writes "dtype", hub downloads carry "torch_dtype".
            checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise InvalidArgument(f"no config.json in model folder {folder}")
        return cls.from_dict(json.loads(path.read_text()))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine instance.

    ``num_pages`` sizes the device KV pool; when None, ``kv_cache_bytes`` decides it.
    ``max_num_batched_tokens`` is the per-step token budget that bounds chunked prefill;
    ``max_num_seqs`` bounds how many requests run at once. ``max_model_len`` caps the
    context (default and upper bound: the model's ``max_position_embeddings``).
    ``model_id`` names the model in the KV namespace (default: the folder's name); workers
    that should share KV pages must agree on it. ``matmul`` picks the linear layers' kernel:
    "onednn" (weights prepacked once; CPU bfloat16 only), "aten" (``F.linear``) or "auto"
    (onednn where it applies). ``decode_kv_bytes`` bounds the decode batch's contiguous K/V
    copy kept across steps (``decode_kv``; the torch path only); 0 gathers the pages at
    every step instead. ``kernels`` picks the elementwise and decode-attention kernels:
    "native" (the fused CPU kernels of ``kernels.cpp``, built on first use), "torch" (torch
    ops) or "auto" (native where they apply and build). ``adapt_threads`` lets a CPU engine
    with several intra-op threads drop to one while its cores are shared with another busy
    process, and come back after (``threads.ThreadTuner``).
    """

    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    model_id: str | None = None
    enable_prefix_cache: bool = True
    matmul: str = "auto"
    decode_kv_bytes: int = 1 << 30
    kernels: str = "auto"
    adapt_threads: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} not accepted; accepted: {list(DTYPES)}")
        if self.page_size <= 0:
            raise InvalidArgument(f"page_size must be > 0, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise InvalidArgument(f"num_pages must be > 0, got {self.num_pages}")
        if self.matmul not in MATMULS:
            raise InvalidArgument(f"matmul {self.matmul!r} not accepted; accepted: {list(MATMULS)}")
        if self.kernels not in KERNELS:
            raise InvalidArgument(
                f"kernels {self.kernels!r} not accepted; accepted: {list(KERNELS)}"
            )
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise InvalidArgument("max_num_batched_tokens and max_num_seqs must be > 0")
