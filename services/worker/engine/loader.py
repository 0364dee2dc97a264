"""Load a Hugging Face-format model folder: config, safetensors (sharded or not), tokenizer.

The same code reads a folder written by ``omniflow.models.make_tiny`` and a downloaded
checkpoint such as Qwen2.5-0.5B.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omniflow.errors import InvalidArgument
from omniflow_services.worker.engine.kv_pool import TORCH_DTYPES
from omniflow_services.worker.engine.model import DecoderModel, LayerWeights
from omniflow_services.worker.llm.model_folder import (
    GenerationDefaults,
    ModelConfig,
    folder_tokenizer,
    load_generation_defaults,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: DecoderModel
    tokenizer: Any | None
    generation: GenerationDefaults


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"no *.safetensors weights in model folder {folder}")
    return files


def _read_tensors(files: list[Path], dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                out[name] = fh.get_tensor(name).to(device=device, dtype=dtype)
    return out


def load_weights(
    cfg: ModelConfig,
    folder: Path,
    dtype: str,
    device: str,
    prepack: bool | None = None,
    kernels: str = "auto",
) -> DecoderModel:
    """Read the checkpoint into a ``DecoderModel`` with fused QKV and gate/up projections.

    ``prepack`` (None: where it applies) reorders linear weights for oneDNN once."""
    t = _read_tensors(_weight_files(folder), TORCH_DTYPES[dtype], device)

    def take(name: str) -> torch.Tensor:
        try:
            return t.pop(name)
        except KeyError:
            raise InvalidArgument(f"weight {name!r} missing from {folder}") from None

    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_w = torch.cat(
            [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]
        )
        qkv_b = None
        if a + "q_proj.bias" in t:
            qkv_b = torch.cat(
                [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")]
            )
        if a + "o_proj.bias" in t:
            raise InvalidArgument(f"{a}o_proj.bias is not supported (attention output bias)")
        layers.append(
            LayerWeights(
                qkv_w=qkv_w,
                qkv_b=qkv_b,
                o_w=take(a + "o_proj.weight"),
                gate_up_w=torch.cat(
                    [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                ),
                down_w=take(p + "mlp.down_proj.weight"),
                in_norm=take(p + "input_layernorm.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise InvalidArgument(
            f"embed_tokens has shape {tuple(embed.shape)}; config says "
            f"({cfg.vocab_size}, {cfg.hidden_size})"
        )
    lm_head = t.pop("lm_head.weight", None)
    if lm_head is None or cfg.tie_word_embeddings:
        lm_head = embed
    norm = take("model.norm.weight")
    leftover = [k for k in t if "rotary_emb" not in k]
    if leftover:
        log.warning("ignoring %d unused weights, e.g. %s", len(leftover), leftover[:3])
    return DecoderModel(cfg, embed, layers, norm, lm_head, prepack=prepack, fused=kernels)


def load_model(
    folder: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    prepack: bool | None = None,
    kernels: str = "auto",
) -> LoadedModel:
    """Load everything the engine needs from a Hugging Face-format folder."""
    path = Path(folder)
    if not path.is_dir():
        raise InvalidArgument(f"model folder {folder} does not exist")
    cfg = ModelConfig.from_folder(path)
    model = load_weights(cfg, path, dtype, device, prepack, kernels)
    return LoadedModel(cfg, model, folder_tokenizer(path), load_generation_defaults(cfg, path))
