"""The talker role: text → codec tokens (a small autoregressive decoder) → 16 kHz audio.

The codec LM is a Llama-format checkpoint loaded by the LLM loader; its vocabulary is the
text vocabulary followed by the codec tokens and two markers (start / end of speech),
described by ``talker_config.json``. Decoding runs on a private paged KV pool with the
engine's batch builder, sampling only among codec tokens. Every ``chunk_tokens`` codec
tokens the vocoder (``vocoder/``: codec embedding, convolution, transposed-convolution
upsampling by ``hop_length``) turns the chunk into PCM, which is streamed at once.

Every talker (this codec talker and the Piper one in ``piper_talker.py``) answers a request
rate of 0 with ``DEFAULT_RATE`` (16 kHz, the worker API's contract) and resamples to any
other rate from 8 to 48 kHz.
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import KVLayout
from omniflow.models.tiny_mm import VOCODER_MODEL_TYPE
from omniflow_services.worker.engine.kv_pool import KVPool
from omniflow_services.worker.engine.loader import load_model
from omniflow_services.worker.engine.model import SeqInput
from omniflow_services.worker.mm.audio_io import StreamResampler, check_rate, pcm_s16
from omniflow_services.worker.mm.media import wav_bytes
from omniflow_services.worker.mm.nn import open_model
from omniflow_services.worker.mm.streaming import iterate_in_thread

log = logging.getLogger(__name__)

PAGE = 16
DEFAULT_RATE = 16000  # what a request rate of 0 gets, from every talker


def check_voice(voice: str, name: str = "default") -> None:
    """A talker serves one voice: "" and "default" name it, as does its own name."""
    if voice not in ("", "default", name):
        accepted = "default" if name == "default" else f"default or {name}"
        raise InvalidArgument(f"voice {voice!r} is not available; accepted: {accepted}")


class Vocoder:
    """Codec tokens [n] → waveform [n * hop_length] in [-1, 1]."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        c, w = open_model(folder, VOCODER_MODEL_TYPE, device)
        self.sample_rate = int(c["sample_rate"])
        self.hop = int(c["hop_length"])
        self.codec_vocab = int(c["codec_vocab_size"])
        self.embed = w.take("codec_embed")
        self.conv_in = w.linear("conv_in")
        self.strides = [int(s) for s in c["upsample_strides"]]
        self.up = [w.linear(f"up.{i}") for i in range(len(self.strides))]

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        x = F.embedding(codes, self.embed).transpose(0, 1)[None]  # [1, E, n]
        x = F.silu(F.conv1d(x, *self.conv_in, padding=1))
        for i, ((w, b), s) in enumerate(zip(self.up, self.strides, strict=True)):
            x = F.conv_transpose1d(x, w, b, stride=s)
            x = torch.tanh(x) if i == len(self.up) - 1 else F.silu(x)
        return x[0, 0]


@dataclass(frozen=True, slots=True)
class AudioChunk:
    pcm_s16le: bytes
    sample_rate: int
    index: int
    last: bool
    wav: bytes = b""  # the whole utterance, on the last chunk


class Talker(ABC):
    """What every talker shares: a request rate of 0 is ``DEFAULT_RATE`` (other rates
    resampled), and ``synthesize`` streams the talker's blocking ``synthesize_sync``."""

    def output_rate(self, requested: int) -> int:
        return check_rate(requested, DEFAULT_RATE)

    @abstractmethod
    def check_text(self, text: str) -> None:
        """Raise InvalidArgument for a text this talker cannot speak."""

    @abstractmethod
    def synthesize_sync(
        self, text: str, seed: int | None, sample_rate: int
    ) -> Iterator[AudioChunk]:
        """Audio chunks as they are decoded; the last carries the whole WAV."""

    async def synthesize(
        self, text: str, seed: int | None = None, sample_rate: int = 0
    ) -> AsyncIterator[AudioChunk]:
        """Stream chunks; decoding runs in a thread, each chunk is sent as soon as it is ready."""
        self.check_text(text)  # bad input fails before the stream starts
        self.output_rate(sample_rate)
        chunks = iterate_in_thread(
            lambda: self.synthesize_sync(text, seed=seed, sample_rate=sample_rate)
        )
        async for ch in chunks:
            yield ch


class TalkerRole(Talker):
    """One codec LM and one vocoder; one utterance is decoded at a time."""

    def __init__(self, folder: Path, device: str = "cpu", dtype: str = "float32") -> None:
        path = folder / "talker_config.json"
        if not path.is_file():
            raise InvalidArgument(f"no talker_config.json in {folder}: not a talker model")
        self.tcfg = t = json.loads(path.read_text())
        loaded = load_model(folder, dtype, device)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        if self.tokenizer is None:
            raise InvalidArgument(f"the talker {folder} has no tokenizer.json")
        self.offset = int(t["codec_offset"])
        self.codec_vocab = int(t["codec_vocab_size"])
        self.bos, self.eos = int(t["codec_bos_id"]), int(t["codec_eos_id"])
        if self.eos >= loaded.config.vocab_size:
            raise InvalidArgument(f"talker codec ids exceed the vocabulary of {folder}")
        self.per_text = int(t["codec_tokens_per_text_token"])
        self.max_codes = int(t["max_codec_tokens"])
        self.chunk = int(t["chunk_tokens"])
        self.vocoder = Vocoder(folder / "vocoder", device)
        if self.vocoder.codec_vocab != self.codec_vocab:
            raise InvalidArgument("the vocoder's codec vocabulary differs from the talker's")
        mc = loaded.config
        self.layout = KVLayout(
            folder.name, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, PAGE
        )
        self.max_len = mc.max_position_embeddings
        pages = -(-self.max_len // PAGE)
        self.pool = KVPool(self.layout, pages, device)
        self.device = torch.device(device)
        self._lock = threading.Lock()

    @property
    def sample_rate(self) -> int:
        return self.vocoder.sample_rate

    def check_voice(self, voice: str) -> None:
        check_voice(voice)

    def check_text(self, text: str) -> None:
        self.prompt(text)

    def prompt(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text).ids)
        if not ids:
            raise InvalidArgument("text is empty: send the text to speak")
        return [*ids, self.bos]

    def budget(self, prompt_len: int) -> int:
        """Codec tokens allowed for a prompt: proportional to the text, within limits."""
        want = max(self.chunk, (prompt_len - 1) * self.per_text)
        return min(want, self.max_codes, self.max_len - prompt_len)

    def _codes(self, text: str, seed: int | None, temperature: float) -> Iterator[list[int]]:
        """Codec tokens (0-based) in chunks of ``chunk_tokens``; the pool is held throughout."""
        ids = self.prompt(text)
        if len(ids) >= self.max_len // 2:
            raise InvalidArgument(
                f"text has {len(ids)} tokens; the talker accepts up to {self.max_len // 2 - 1}"
            )
        budget = self.budget(len(ids))
        pages = list(range(-(-(len(ids) + budget) // PAGE)))
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        lo, hi = self.offset, self.offset + self.codec_vocab
        tokens, start, chunk = list(ids), 0, []
        for _ in range(budget):
            logits = self.model.logits_for(SeqInput(tokens[start:], start, pages, True), self.pool)
            allowed = torch.cat([logits[lo:hi], logits[self.eos : self.eos + 1]])
            if temperature > 0:
                probs = torch.softmax(allowed / temperature, -1)
                pick = int(torch.multinomial(probs, 1, generator=gen).item())
            else:
                pick = int(allowed.argmax().item())
            if pick == self.codec_vocab:  # end of speech
                break
            start = len(tokens)
            tokens.append(lo + pick)
            chunk.append(pick)
            if len(chunk) == self.chunk:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def synthesize_sync(
        self,
        text: str,
        seed: int | None = None,
        temperature: float = 0.8,
        sample_rate: int = 0,
    ) -> Iterator[AudioChunk]:
        """Audio chunks as codec chunks are decoded; the last carries the whole WAV."""
        rate = self.output_rate(sample_rate)
        with self._lock:
            resample = StreamResampler(self.sample_rate, rate)
            pcm_all: list[bytes] = []
            pending: AudioChunk | None = None
            for i, codes in enumerate(self._codes(text, seed, temperature)):
                wave = self.vocoder(torch.tensor(codes, dtype=torch.long, device=self.device))
                pcm = pcm_s16(resample(wave.float().cpu().numpy()))
                pcm_all.append(pcm)
                if pending is not None:
                    yield pending
                pending = AudioChunk(pcm, rate, i, False)
            if pending is None:  # ended at once: an empty utterance is still a valid WAV
                pending = AudioChunk(b"", rate, 0, False)
            tail = pcm_s16(resample(np.zeros(0, np.float32), last=True))
            pcm_all.append(tail)
            yield AudioChunk(
                pending.pcm_s16le + tail,
                rate,
                pending.index,
                True,
                wav_bytes(b"".join(pcm_all), rate),
            )
