"""Rotary position embeddings with the scaling variants of Hugging Face ``config.json``.

The inverse frequencies follow transformers' ``modeling_rope_utils`` formulas (default,
linear, llama3, yarn exactly; dynamic NTK recomputes the base from the longest position of
the current forward, which equals transformers for a forward that starts at position 0).
"""

from __future__ import annotations

import math

import torch

from omniflow_services.worker.llm.model_folder import ModelConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    base = cfg.rope_theta
    orig = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = s.get("factor") or cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


class Rotary:
    """Computes cos/sin tables for arbitrary positions (float32 math, cast to the model dtype)."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self._cfg = cfg
        self._device = device
        self.dim = cfg.head_dim
        s = cfg.rope_scaling or {}
        self.rope_type = s.get("rope_type", "default")
        self.attention_scaling = 1.0
        inv = _base_inv_freq(cfg.rope_theta, self.dim)
        if self.rope_type == "linear":
            inv = inv / s["factor"]
        elif self.rope_type == "llama3":
            inv = _llama3(inv, s)
        elif self.rope_type == "yarn":
            inv, self.attention_scaling = _yarn(cfg, self.dim, s)
        self.inv_freq = inv.to(device)

    def _inv_freq_for(self, max_pos: int) -> torch.Tensor:
        if self.rope_type != "dynamic":
            return self.inv_freq
        seq_len = max_pos + 1
        max_pe = self._cfg.max_position_embeddings
        if seq_len <= max_pe:
            return self.inv_freq
        factor = self._cfg.rope_scaling["factor"]  # type: ignore[index]
        base = self._cfg.rope_theta * ((factor * seq_len / max_pe) - (factor - 1)) ** (
            self.dim / (self.dim - 2)
        )
        return _base_inv_freq(base, self.dim).to(self._device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, max_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, head_dim] for the int64 ``positions`` [T]."""
        freqs = positions[:, None].float() * self._inv_freq_for(max_pos)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] by cos/sin [T, D] (the rotate-half convention).

    Both halves of the tables are equal, so each output half is ``x1*c - x2*s`` or
    ``x2*c + x1*s`` over half-width tables: half-size ops instead of building the rotated
    copy (cat, neg) and three full-size ones. Every product and sum rounds as in
    transformers' ``q * cos + rotate_half(q) * sin``, so the result is bit-identical to it
    in every dtype (an ``addcmul_`` would round once fewer and differ in bfloat16)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1).sub_(x2 * s)
    torch.mul(x2, c, out=o2).add_(x1 * s)
    return out
