"""Building blocks of the multimodal models over plain weight tensors (no nn.Module).

Weights come from a folder's ``config.json`` + ``model.safetensors``; ``Weights.take``
names what is missing, so a checkpoint that does not fit fails at load with a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omniflow.errors import InvalidArgument

Linear = tuple[torch.Tensor, torch.Tensor | None]  # a weight and its bias, if any


def read_config(folder: Path, model_type: str) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise InvalidArgument(f"no config.json in model folder {folder}")
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") != model_type:
        raise InvalidArgument(
            f"{folder} holds model_type {cfg.get('model_type')!r}; this role needs {model_type!r}"
        )
    return cfg


class Weights:
    """The tensors of one ``model.safetensors``, taken by name."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        from safetensors.torch import load_file

        path = folder / "model.safetensors"
        if not path.is_file():
            raise InvalidArgument(f"no model.safetensors in {folder}")
        self.folder = folder
        self._t = {k: v.float().to(device) for k, v in load_file(str(path)).items()}

    def take(self, name: str) -> torch.Tensor:
        try:
            return self._t[name]
        except KeyError:
            raise InvalidArgument(f"weight {name!r} missing from {self.folder}") from None

    def linear(self, name: str) -> Linear:
        return self.take(name + ".weight"), self._t.get(name + ".bias")

    def group(self, prefix: str, names: Mapping[str, str]) -> dict[str, Linear]:
        """The linears ``prefix + name`` for each ``key: name`` of ``names``, by key."""
        return {key: self.linear(prefix + name) for key, name in names.items()}

    def layers(self, prefix: str, count: int, names: Mapping[str, str]) -> list[dict[str, Linear]]:
        """``group(f"{prefix}{i}.", names)`` of each layer ``i`` below ``count``."""
        return [self.group(f"{prefix}{i}.", names) for i in range(count)]


def open_model(folder: Path, model_type: str, device: str) -> tuple[dict[str, Any], Weights]:
    """A model folder of ``model_type``: its ``config.json`` and its weights on ``device``."""
    return read_config(folder, model_type), Weights(folder, device)


_STACK_LAYER = {
    "n1": "norm1",
    "qkv": "attn.qkv",
    "proj": "attn.proj",
    "n2": "norm2",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}


class EncoderStack:
    """Pre-norm bidirectional transformer layers (``layers.{i}.*``) and ``post_norm``."""

    def __init__(self, w: Weights, num_layers: int, num_heads: int, eps: float) -> None:
        self.layers = w.layers("layers.", num_layers, _STACK_LAYER)
        self.post_norm = w.linear("post_norm")
        self.heads = num_heads
        self.eps = eps

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` [T, hidden] → [T, hidden]; every token attends to every token."""
        t, d = h.shape
        for ly in self.layers:
            x = F.layer_norm(h, (d,), *ly["n1"], self.eps)
            q, k, v = F.linear(x, *ly["qkv"]).view(t, 3, self.heads, -1).permute(1, 2, 0, 3)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
            h = h + F.linear(a.transpose(0, 1).reshape(t, d), *ly["proj"])
            x = F.layer_norm(h, (d,), *ly["n2"], self.eps)
            h = h + F.linear(F.gelu(F.linear(x, *ly["fc1"])), *ly["fc2"])
        return F.layer_norm(h, (d,), *self.post_norm, self.eps)


class Projector:
    """States → the LLM's hidden size: ``fc1``, GELU, ``fc2`` (weights under ``prefix``)."""

    def __init__(self, w: Weights, prefix: str = "") -> None:
        self.fc1, self.fc2 = w.linear(prefix + "fc1"), w.linear(prefix + "fc2")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(h, *self.fc1)), *self.fc2)


def sinusoid(positions: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embeddings [len(positions), dim] (float positions allowed: timesteps)."""
    half = dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(max_period)) * torch.arange(half) / half)
    args = positions.float()[:, None] * freqs[None, :].to(positions.device)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
