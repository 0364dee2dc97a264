"""Image generation on the LLM's backbone (DESIGN §4.4), HunyuanImage-3 style.

The prompt is prefilled once by the LLM engine into KV pages (so it is cached, shared
and fetchable like any prompt); the denoiser runs the same backbone layers over a
timestep token plus the image's latent tokens, which attend to each other in both
directions and to the cached prompt K/V (the prompt never attends to the image, so its
K/V stay valid for every step). A flow-matching Euler sampler with classifier-free
guidance (conditional and unconditional prefixes, both cached) produces latents that a
small convolutional decoder turns into pixels.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from omniflow.errors import InvalidArgument
from omniflow.models.tiny_mm import IMAGE_HEAD_MODEL_TYPE
from omniflow_services.worker.engine.model import DecoderModel
from omniflow_services.worker.mm.nn import open_model, sinusoid


@dataclass(frozen=True, slots=True)
class PromptKV:
    """A prefilled prompt: K and V [layers, kv_heads, length, head_dim], and its length."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[2])


def run_backbone(
    model: DecoderModel,
    h: torch.Tensor,
    positions: torch.Tensor,
    prefix: PromptKV | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder layers over ``h`` [T, hidden] at ``positions``; returns final-normed
    hidden states [T, hidden]. Keys are the ``prefix`` K/V (if any) followed by ``h``'s own;
    ``mask`` [T, keys] (True = visible) defaults to everything visible."""

    def bidirectional(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if prefix is not None:
            k = torch.cat([prefix.k[li].to(k.dtype), k], dim=1)
            v = torch.cat([prefix.v[li].to(v.dtype), v], dim=1)
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=model.scale, enable_gqa=True
        )[0]
        return o.transpose(0, 1)

    h = model.run_layers(h.to(model.dtype), positions, bidirectional)
    return model.norm(h).float()


class ImageHead:
    """Latent in/out projections, timestep embedder and latent decoder over a backbone."""

    def __init__(self, folder: Path, model: DecoderModel, device: str = "cpu") -> None:
        c, w = open_model(folder, IMAGE_HEAD_MODEL_TYPE, device)
        self.cfg, self.model = c, model
        self.channels = int(c["latent_channels"])
        self.patch = int(c["latent_patch"])
        self.scale = int(c["vae_scale"])
        self.t_dim = int(c["timestep_dim"])
        self.latent_in = w.linear("latent_in")
        self.latent_out = w.linear("latent_out")
        if self.latent_in[0].shape[0] != model.cfg.hidden_size:
            raise InvalidArgument(
                f"image head {folder} projects to hidden {self.latent_in[0].shape[0]}; its "
                f"backbone has hidden {model.cfg.hidden_size}"
            )
        self.time = (w.linear("time_embed.fc1"), w.linear("time_embed.fc2"))
        self.image_start = w.take("image_start")
        self.dec_in = w.linear("decoder.conv_in")
        self.dec_up = [w.linear(f"decoder.up.{i}") for i in range(int(c["decoder_upsamples"]))]
        self.dec_out = w.linear("decoder.conv_out")

    @property
    def pixels_per_token(self) -> int:
        return self.scale * self.patch

    def check_size(self, width: int, height: int) -> None:
        unit, top = self.pixels_per_token, int(self.cfg["max_size"])
        for name, v in (("width", width), ("height", height)):
            if v <= 0 or v % unit or v > top:
                raise InvalidArgument(
                    f"{name} {v} is not accepted; accepted: multiples of {unit} up to {top}"
                )

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        return (self.channels, height // self.scale, width // self.scale)

    # --- denoiser -----------------------------------------------------------------------------

    def _tokens(self, x: torch.Tensor, t: float) -> torch.Tensor:
        """Timestep token + latent patches as backbone inputs [1 + n, hidden]."""
        p = self.patch
        patches = F.unfold(x[None], kernel_size=p, stride=p)[0].transpose(0, 1)
        lat = F.linear(patches, *self.latent_in)
        (w1, b1), (w2, b2) = self.time
        ts = sinusoid(torch.tensor([t * 1000.0], device=x.device), self.t_dim)
        temb = F.linear(F.silu(F.linear(ts, w1, b1)), w2, b2)
        return torch.cat([self.image_start[None] + temb, lat])

    def _velocity_from(self, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(hidden[1:], *self.latent_out)  # drop the timestep token
        _, hh, ww = x.shape
        return F.fold(
            out.transpose(0, 1)[None], (hh, ww), kernel_size=self.patch, stride=self.patch
        )[0]

    @torch.inference_mode()
    def velocity(self, x: torch.Tensor, t: float, prefix: PromptKV) -> torch.Tensor:
        """The velocity at ``x`` (latents [C, h, w]) attending to the cached prompt K/V."""
        h = self._tokens(x, t)
        pos = torch.arange(prefix.length, prefix.length + h.shape[0], device=h.device)
        return self._velocity_from(run_backbone(self.model, h, pos, prefix), x)

    @torch.inference_mode()
    def velocity_recompute(self, x: torch.Tensor, t: float, prompt_ids: list[int]) -> torch.Tensor:
        """The same velocity with the prompt recomputed in the same forward (the reference:
        prompt rows causal among themselves, image rows see the prompt and the image)."""
        img = self._tokens(x, t)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=img.device)
        txt = F.embedding(ids, self.model.embed).float()
        h = torch.cat([txt, img])
        n, p = h.shape[0], len(prompt_ids)
        mask = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        mask[p:, :] = True
        pos = torch.arange(n, device=h.device)
        return self._velocity_from(run_backbone(self.model, h, pos, None, mask)[p:], x)

    # --- decoder ------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [C, h, w] → RGB uint8 [H, W, 3]."""
        x = F.silu(F.conv2d(latents[None], *self.dec_in, padding=1))
        for w, b in self.dec_up:
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            x = F.silu(F.conv2d(x, w, b, padding=1))
        x = torch.tanh(F.conv2d(x, *self.dec_out, padding=1))[0]
        return ((x + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)


Velocity = Callable[[torch.Tensor, float], torch.Tensor]


def flow_euler(
    velocity_cond: Velocity,
    velocity_uncond: Velocity | None,
    noise: torch.Tensor,
    steps: int,
    guidance: float,
) -> torch.Tensor:
    """Integrate dx/dt = v from t=1 (noise) to t=0 in ``steps`` Euler steps, with
    classifier-free guidance ``v = v_u + g (v_c - v_u)`` when an unconditional path is given."""
    ts = torch.linspace(1.0, 0.0, steps + 1).tolist()
    x = noise.clone()
    for i in range(steps):
        t, dt = ts[i], ts[i] - ts[i + 1]
        v = velocity_cond(x, t)
        if velocity_uncond is not None and guidance != 1.0:
            vu = velocity_uncond(x, t)
            v = vu + guidance * (v - vu)
        x = x - dt * v
    return x


def initial_noise(shape: tuple[int, int, int], seed: int | None) -> torch.Tensor:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return torch.randn(*shape, generator=gen)


def png_bytes(rgb: torch.Tensor) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb.cpu().numpy(), "RGB").save(buf, "PNG")
    return buf.getvalue()
