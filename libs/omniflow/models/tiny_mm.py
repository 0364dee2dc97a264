"""Random-initialised multimodal models in their on-disk formats (config.json + safetensors).

Kinds (``make_tiny_kind``):

- ``vision-encoder``: patch embedding, transformer, projector into the LLM's hidden size.
- ``audio-encoder``: log-mel front end (computed, no weights), convolutions, transformer,
  projector.
- ``diffusion``: an image head on an LLM backbone: ``config.json`` names the backbone (a
  folder or ``tiny:<arch>``); the head holds the latent in/out projections, the timestep
  embedder and a small convolutional latent decoder. The backbone is the LLM's own folder,
  so both roles share its weights and its KV namespace.
- ``talker``: a Llama-format decoder whose vocabulary is the text vocabulary followed by the
  codec tokens (loaded by the LLM loader), plus ``talker_config.json`` and a ``vocoder/``
  folder (codec tokens → 16 kHz waveform).

The worker loads these with the same code that would load real checkpoints in these formats.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

MM_KINDS = ("vision-encoder", "audio-encoder", "diffusion", "talker")
VISION_MODEL_TYPE = "omniflow_vision_encoder"
AUDIO_MODEL_TYPE = "omniflow_audio_encoder"
IMAGE_HEAD_MODEL_TYPE = "omniflow_image_head"
VOCODER_MODEL_TYPE = "omniflow_vocoder"


def _gen(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def _lin(w: dict[str, Any], name: str, out_f: int, in_f: int, gen: Any, bias: bool = True) -> None:
    import torch

    w[name + ".weight"] = torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)
    if bias:
        w[name + ".bias"] = 0.02 * torch.randn(out_f, generator=gen)


def _norm(w: dict[str, Any], name: str, n: int, gen: Any) -> None:
    import torch

    w[name + ".weight"] = 1.0 + 0.1 * torch.randn(n, generator=gen)
    w[name + ".bias"] = 0.02 * torch.randn(n, generator=gen)


def _conv(w: dict[str, Any], name: str, shape: tuple[int, ...], fan_in: int, gen: Any) -> None:
    import torch

    w[name + ".weight"] = torch.randn(*shape, generator=gen) / math.sqrt(fan_in)
    w[name + ".bias"] = 0.02 * torch.randn(shape[0], generator=gen)


@dataclass(frozen=True, slots=True)
class EncoderSize:
    """The transformer trunk the vision and audio encoders share, and its projector."""

    out_hidden: int = 64  # the LLM's hidden size: what the projector writes
    hidden: int = 64
    layers: int = 2
    heads: int = 4

    def add_trunk(self, w: dict[str, Any], gen: Any) -> None:
        """The trunk's layers, its final norm and the projector into ``out_hidden``."""
        h, inter = self.hidden, 2 * self.hidden
        for i in range(self.layers):
            p = f"layers.{i}."
            _norm(w, p + "norm1", h, gen)
            _lin(w, p + "attn.qkv", 3 * h, h, gen)
            _lin(w, p + "attn.proj", h, h, gen)
            _norm(w, p + "norm2", h, gen)
            _lin(w, p + "mlp.fc1", inter, h, gen)
            _lin(w, p + "mlp.fc2", h, inter, gen)
        _norm(w, "post_norm", h, gen)
        _lin(w, "projector.fc1", self.out_hidden, h, gen)
        _lin(w, "projector.fc2", self.out_hidden, self.out_hidden, gen)

    def config(self) -> dict[str, Any]:
        """The trunk's keys of the encoder's ``config.json``."""
        return {
            "hidden_size": self.hidden,
            "num_layers": self.layers,
            "num_heads": self.heads,
            "intermediate_size": 2 * self.hidden,
            "out_hidden_size": self.out_hidden,
            "layer_norm_eps": 1e-6,
        }


def _save(folder: Path, config: dict[str, Any], weights: dict[str, Any]) -> Path:
    """``config.json`` and ``model.safetensors`` (float32) into ``folder``; returns it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.float().contiguous() for k, v in weights.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def make_vision_encoder(
    out_dir: str | Path,
    size: EncoderSize = EncoderSize(),
    *,
    image_size: int = 32,
    patch_size: int = 8,
    seed: int = 0,
) -> Path:
    """A ViT-style encoder: ``(image_size / patch_size)**2`` tokens per image."""
    if image_size % patch_size or size.hidden % size.heads:
        raise InvalidArgument("image_size must divide by patch_size and hidden by heads")
    import torch

    gen = _gen(seed)
    n = (image_size // patch_size) ** 2
    w: dict[str, Any] = {}
    _lin(w, "patch_embed", size.hidden, 3 * patch_size * patch_size, gen)
    w["pos_embed"] = 0.02 * torch.randn(n, size.hidden, generator=gen)
    size.add_trunk(w, gen)
    config = {
        "model_type": VISION_MODEL_TYPE,
        "image_size": image_size,
        "patch_size": patch_size,
        **size.config(),
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "max_image_pixels": 4096 * 4096,
        "max_bytes": 20 * 1024 * 1024,
    }
    return _save(Path(out_dir), config, w)


def make_audio_encoder(
    out_dir: str | Path,
    size: EncoderSize = EncoderSize(),
    *,
    mel_bins: int = 32,
    seed: int = 1,
) -> Path:
    """A Whisper-style encoder over log-mel frames: one token per 4 frames (40 ms)."""
    gen = _gen(seed)
    w: dict[str, Any] = {}
    _conv(w, "conv1", (size.hidden, mel_bins, 3), mel_bins * 3, gen)
    _conv(w, "conv2", (size.hidden, size.hidden, 3), size.hidden * 3, gen)
    size.add_trunk(w, gen)
    config = {
        "model_type": AUDIO_MODEL_TYPE,
        "sample_rate": 16000,
        "n_fft": 400,
        "hop_length": 160,
        "num_mel_bins": mel_bins,
        **size.config(),
        "max_seconds": 30.0,
    }
    return _save(Path(out_dir), config, w)


def make_image_head(
    out_dir: str | Path,
    *,
    backbone: str = "tiny:qwen2",
    backbone_hidden: int = 64,
    latent_channels: int = 4,
    latent_patch: int = 2,
    vae_scale: int = 8,
    seed: int = 2,
) -> Path:
    """The image-generation head over the backbone named in its config (tokens: one per
    ``latent_patch``² latent cells, i.e. per ``(vae_scale * latent_patch)``² pixels)."""
    import torch

    gen = _gen(seed)
    h = backbone_hidden
    patch_dim = latent_channels * latent_patch * latent_patch
    t_dim = 64
    w: dict[str, Any] = {}
    _lin(w, "latent_in", h, patch_dim, gen)
    _lin(w, "latent_out", patch_dim, h, gen)
    _lin(w, "time_embed.fc1", h, t_dim, gen)
    _lin(w, "time_embed.fc2", h, h, gen)
    w["image_start"] = 0.25 * torch.randn(h, generator=gen)
    chans = [latent_channels, 32, 32, 16]
    _conv(w, "decoder.conv_in", (chans[1], chans[0], 3, 3), chans[0] * 9, gen)
    ups = int(math.log2(vae_scale))
    c = chans[1]
    for i in range(ups):
        nxt = chans[min(i + 2, len(chans) - 1)]
        _conv(w, f"decoder.up.{i}", (nxt, c, 3, 3), c * 9, gen)
        c = nxt
    _conv(w, "decoder.conv_out", (3, c, 3, 3), c * 9, gen)
    config = {
        "model_type": IMAGE_HEAD_MODEL_TYPE,
        "backbone": backbone,
        "latent_channels": latent_channels,
        "latent_patch": latent_patch,
        "vae_scale": vae_scale,
        "timestep_dim": t_dim,
        "decoder_upsamples": ups,
        "default_size": 64,
        "max_size": 512,
        "default_steps": 8,
        "max_steps": 100,
        "default_guidance": 3.0,
    }
    return _save(Path(out_dir), config, w)


def make_talker(
    out_dir: str | Path,
    *,
    codec_vocab: int = 256,
    hop_length: int = 320,
    seed: int = 3,
) -> Path:
    """A Llama-format codec LM (text vocabulary + codec tokens) and its vocoder."""
    from omniflow.models.tiny import make_tiny

    out = Path(out_dir)
    make_tiny("llama", out, vocab=512, seed=seed)
    # Widen the vocabulary: text ids keep their meaning, codec id c is text_vocab + c, and
    # two more ids mark the start and end of speech.
    config = json.loads((out / "config.json").read_text())
    text_vocab = int(config["vocab_size"])
    total = text_vocab + codec_vocab + 2
    import torch
    from safetensors.torch import load_file, save_file

    gen = _gen(seed + 100)
    weights = load_file(str(out / "model.safetensors"))
    hidden = int(config["hidden_size"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = 0.25 * torch.randn(total - text_vocab, hidden, generator=gen)
        weights[name] = torch.cat([weights[name], extra]).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["vocab_size"] = total
    (out / "config.json").write_text(json.dumps(config, indent=2))
    talker = {
        "codec_offset": text_vocab,
        "codec_vocab_size": codec_vocab,
        "codec_bos_id": text_vocab + codec_vocab,
        "codec_eos_id": text_vocab + codec_vocab + 1,
        "codec_tokens_per_text_token": 4,
        "max_codec_tokens": 1500,
        "chunk_tokens": 25,
    }
    (out / "talker_config.json").write_text(json.dumps(talker, indent=2))
    vgen = _gen(seed + 200)
    emb = 64
    w: dict[str, Any] = {"codec_embed": torch.randn(codec_vocab, emb, generator=vgen)}
    _conv(w, "conv_in", (emb, emb, 3), emb * 3, vgen)
    strides = [10, 8, 4]
    if math.prod(strides) != hop_length:
        raise InvalidArgument(f"hop_length must be {math.prod(strides)} for this vocoder")
    chans = [emb, 32, 16, 1]
    for i, s in enumerate(strides):
        # ConvTranspose1d weights are [in, out, kernel].
        w[f"up.{i}.weight"] = torch.randn(chans[i], chans[i + 1], s, generator=vgen) / math.sqrt(
            chans[i]
        )
        w[f"up.{i}.bias"] = 0.02 * torch.randn(chans[i + 1], generator=vgen)
    vcfg = {
        "model_type": VOCODER_MODEL_TYPE,
        "sample_rate": 16000,
        "hop_length": hop_length,
        "codec_vocab_size": codec_vocab,
        "embed_dim": emb,
        "upsample_strides": strides,
        "channels": chans,
    }
    _save(out / "vocoder", vcfg, w)
    return out


def make_tiny_kind(kind: str, out_dir: str | Path, seed: int | None = None) -> Path:
    """Write the tiny model of ``kind`` (one of ``MM_KINDS``) with its default sizes."""
    kw: dict[str, Any] = {} if seed is None else {"seed": seed}
    if kind == "vision-encoder":
        return make_vision_encoder(out_dir, **kw)
    if kind == "audio-encoder":
        return make_audio_encoder(out_dir, **kw)
    if kind == "diffusion":
        return make_image_head(out_dir, **kw)
    if kind == "talker":
        return make_talker(out_dir, **kw)
    raise InvalidArgument(f"unknown model kind {kind!r}; accepted: {list(MM_KINDS)}")
