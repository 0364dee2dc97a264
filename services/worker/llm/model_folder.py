"""An llm model folder in the Hugging Face format, as every llm engine of the worker reads it:
``config.json`` (``ModelConfig``), ``generation_config.json`` (``GenerationDefaults``) and
the tokenizer (the library's one ``omniflow.chat.load_tokenizer``; a folder without
``tokenizer.json`` serves token-id prompts only). Torch-free.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniflow.chat import load_tokenizer
from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


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
class GenerationDefaults:
    """Defaults from ``generation_config.json`` (falling back to ``config.json``)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


def folder_tokenizer(folder: Path) -> Any | None:
    """The folder's tokenizer, or None when it has no ``tokenizer.json`` (token-id prompts
    only: text and chat prompts are refused by the role). A malformed file raises, as
    ``load_tokenizer`` does."""
    if not (folder / "tokenizer.json").is_file():
        log.warning("no tokenizer.json in %s: text input/output disabled", folder)
        return None
    return load_tokenizer(folder)


def load_generation_defaults(cfg: ModelConfig, folder: Path) -> GenerationDefaults:
    eos = cfg.eos_token_ids
    bos = cfg.bos_token_id
    path = folder / "generation_config.json"
    if path.is_file():
        raw = json.loads(path.read_text())
        e = raw.get("eos_token_id")
        if e is not None:
            eos = tuple(e) if isinstance(e, list) else (int(e),)
        bos = raw.get("bos_token_id", bos)
    return GenerationDefaults(eos_token_ids=tuple(int(x) for x in eos), bos_token_id=bos)
