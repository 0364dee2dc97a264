"""Encoder role: images and audio → embeddings in the LLM's hidden size, cached by item id.

A vision encoder (patches → transformer → projector) and an audio encoder (log-mel →
two convolutions → transformer → projector) are loaded from their folders
(``config.json`` + ``model.safetensors``); an audio folder may also be any Hugging Face
Whisper folder (``model_type`` whisper, see ``whisper.py``), which also transcribes. The
cache maps an item id (xxh3_128 of the raw bytes, DESIGN §4.1) to its embeddings, so an
item already seen is not encoded again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omniflow.errors import FailedPrecondition, InvalidArgument
from omniflow.kv.blocks import item_id
from omniflow.models.tiny_mm import AUDIO_MODEL_TYPE, VISION_MODEL_TYPE
from omniflow_services.worker.mm.media import (
    AUDIO,
    IMAGE,
    MediaInput,
    decode_image,
    decode_wav,
    log_mel,
)
from omniflow_services.worker.mm.nn import EncoderStack, Projector, Weights, open_model, sinusoid
from omniflow_services.worker.mm.whisper import WHISPER_MODEL_TYPE, Transcript, WhisperEncoder
from omniflow_services.worker.mm.whisper_decode import TranscribeOptions

log = logging.getLogger(__name__)


class _Tower:
    """What the vision and audio towers share (``tiny_mm``'s format): transformer layers
    and ``post_norm`` (an ``EncoderStack``), then ``projector.*`` into the LLM's hidden size."""

    def _open(self, folder: Path, model_type: str, device: str) -> tuple[dict[str, Any], Weights]:
        c, w = open_model(folder, model_type, device)
        self.cfg = c
        self.out_hidden = int(c["out_hidden_size"])
        self.stack = EncoderStack(w, int(c["num_layers"]), int(c["num_heads"]), c["layer_norm_eps"])
        self.proj = Projector(w, "projector.")
        return c, w

    def _tower(self, h: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, hidden] → [T, out_hidden]."""
        return self.proj(self.stack(h))


class VisionEncoder(_Tower):
    """ViT-style image encoder; ``tokens_per_image`` tokens of ``out_hidden`` each."""

    kind = IMAGE

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        c, w = self._open(folder, VISION_MODEL_TYPE, device)
        self.size, self.patch = int(c["image_size"]), int(c["patch_size"])
        self.tokens_per_image = (self.size // self.patch) ** 2
        self.patch_embed = w.linear("patch_embed")
        self.pos_embed = w.take("pos_embed")

    def preprocess(self, item: MediaInput) -> torch.Tensor:
        c = self.cfg
        return decode_image(
            item, self.size, c["image_mean"], c["image_std"], c["max_image_pixels"], c["max_bytes"]
        )

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, size, size] → [tokens_per_image, out_hidden]."""
        p = self.patch
        pixels = pixels.to(self.pos_embed.device)
        patches = F.unfold(pixels[None], kernel_size=p, stride=p)[0].transpose(0, 1)
        return self._tower(F.linear(patches, *self.patch_embed) + self.pos_embed)


class AudioEncoder(_Tower):
    """Whisper-style audio encoder: one token per 4 log-mel frames (40 ms at 16 kHz)."""

    kind = AUDIO

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        c, w = self._open(folder, AUDIO_MODEL_TYPE, device)
        self.sample_rate = int(c["sample_rate"])
        self.hidden = int(c["hidden_size"])
        self.conv1 = w.linear("conv1")
        self.conv2 = w.linear("conv2")

    def preprocess(self, item: MediaInput) -> torch.Tensor:
        c = self.cfg
        samples = decode_wav(item, self.sample_rate, float(c["max_seconds"]))
        return log_mel(samples, c["n_fft"], c["hop_length"], c["num_mel_bins"], self.sample_rate)

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """[mels, frames] → [ceil(frames / 4), out_hidden]."""
        x = F.gelu(F.conv1d(mel[None].to(self.conv1[0].device), *self.conv1, padding=1))
        x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1))
        x = F.avg_pool1d(x, 2, 2, ceil_mode=True)[0].transpose(0, 1)
        return self._tower(x + sinusoid(torch.arange(x.shape[0], device=x.device), self.hidden))


Encoder = VisionEncoder | AudioEncoder | WhisperEncoder


def load_encoder(folder: Path, device: str = "cpu") -> Encoder:
    """The encoder a folder holds, by its ``config.json`` model_type."""
    path = folder / "config.json"
    if not path.is_file():
        raise InvalidArgument(f"no config.json in model folder {folder}")
    mt = json.loads(path.read_text()).get("model_type")
    if mt == VISION_MODEL_TYPE:
        return VisionEncoder(folder, device)
    if mt == AUDIO_MODEL_TYPE:
        return AudioEncoder(folder, device)
    if mt == WHISPER_MODEL_TYPE:
        return WhisperEncoder(folder, device)
    raise InvalidArgument(
        f"{folder} holds model_type {mt!r}; an encoder worker accepts "
        f"{VISION_MODEL_TYPE!r}, {AUDIO_MODEL_TYPE!r} or {WHISPER_MODEL_TYPE!r}"
    )


class EncoderCache:
    """LRU of embeddings by item id, bounded in bytes; thread-safe."""

    def __init__(self, capacity_bytes: int = 256 * 1024 * 1024) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            emb = self._items.get(key)
            if emb is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return emb

    def put(self, key: bytes, emb: torch.Tensor) -> None:
        size = emb.numel() * emb.element_size()
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            self._items[key] = emb
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, ev = self._items.popitem(last=False)
                self._bytes -= ev.numel() * ev.element_size()


@dataclass(frozen=True, slots=True)
class EncodedEmbeddings:
    """One item's id, embeddings [tokens, hidden] (float32, CPU) and whether it was cached."""

    item_id: bytes
    embeddings: torch.Tensor
    cached: bool


class EncoderRole:
    """The encoders of one worker (at most one per media kind) and their shared cache."""

    def __init__(self, encoders: list[Encoder], cache: EncoderCache | None = None) -> None:
        self.encoders: dict[str, Encoder] = {}
        for e in encoders:
            if e.kind in self.encoders:
                raise InvalidArgument(f"two {e.kind} encoders given; load one per media kind")
            self.encoders[e.kind] = e
        if not self.encoders:
            raise InvalidArgument("an encoder worker needs at least one encoder model")
        # A Whisper folder without a projector only transcribes: it has no hidden size.
        hidden = {e.out_hidden for e in encoders if e.out_hidden is not None}
        if len(hidden) > 1:
            raise InvalidArgument(f"encoders project to different hidden sizes {sorted(hidden)}")
        self.out_hidden = hidden.pop() if hidden else 0
        self.cache = cache or EncoderCache()
        self._lock = threading.Lock()

    @classmethod
    async def load(cls, folders: list[Path], device: str = "cpu") -> EncoderRole:
        encoders = await asyncio.to_thread(lambda: [load_encoder(f, device) for f in folders])
        return cls(encoders)

    def encoder_for(self, item: MediaInput) -> Encoder:
        enc = self.encoders.get(item.kind)
        if enc is None:
            raise InvalidArgument(
                f"{item.name}: {item.kind or 'unspecified'} items are not accepted by this "
                f"encoder; accepted: {', '.join(sorted(self.encoders))}"
            )
        return enc

    def encode_sync(self, items: list[MediaInput]) -> list[EncodedEmbeddings]:
        """Encode every item (cache first). All items are decoded and checked before any
        is encoded, so a bad item fails the call without work done for the others."""
        ids = [item_id(it.data) for it in items]
        cached = [self.cache.get(i) for i in ids]
        inputs: dict[int, torch.Tensor] = {}
        for k, (it, hit) in enumerate(zip(items, cached, strict=True)):
            if hit is None:
                inputs[k] = self.encoder_for(it).preprocess(it)
        out = []
        with self._lock:  # one encode at a time: torch threads are the parallelism
            for k, it in enumerate(items):
                emb = cached[k]
                if emb is None:
                    emb = self.encoder_for(it).encode(inputs[k]).float().cpu().contiguous()
                    self.cache.put(ids[k], emb)
                out.append(EncodedEmbeddings(ids[k], emb, cached[k] is not None))
        return out

    async def encode(self, items: list[MediaInput]) -> list[EncodedEmbeddings]:
        return await asyncio.to_thread(self.encode_sync, items)

    @property
    def operations(self) -> tuple[str, ...]:
        """Operations beyond ``encode`` that the loaded encoders serve."""
        return ("transcribe",) if isinstance(self.encoders.get(AUDIO), WhisperEncoder) else ()

    @property
    def transcribe_model(self) -> str:
        """The folder of the Whisper model that transcribes ("" without one)."""
        enc = self.encoders.get(AUDIO)
        return str(enc.folder) if isinstance(enc, WhisperEncoder) else ""

    async def transcribe(
        self, item: MediaInput, opts: TranscribeOptions | None = None
    ) -> Transcript:
        """Speech → text with the worker's Whisper model (FailedPrecondition without one)."""
        enc = self.encoders.get(AUDIO)
        if not isinstance(enc, WhisperEncoder):
            raise FailedPrecondition(
                "transcribe needs a Whisper audio encoder on this worker (model_type whisper, "
                "e.g. omniflow models pull whisper-tiny.en); this one has "
                f"{type(enc).__name__ if enc else 'no audio encoder'}"
            )
        return await asyncio.to_thread(enc.transcript, item, opts)
