"""A BERT encoder with sentence-transformers' pooling, over plain weight tensors.

The folder is what ``SentenceTransformer.save`` writes: ``config.json`` (``model_type``
bert) and ``model.safetensors`` of a ``BertModel``, ``tokenizer.json``, ``modules.json``
naming the modules after the transformer (``Pooling``, ``Normalize``),
``1_Pooling/config.json`` (the pooling mode) and ``sentence_bert_config.json``
(``max_seq_length``). The forward pass is BERT's: word + position + token-type embeddings
and a LayerNorm, then post-norm layers (self-attention over the unpadded keys, GELU MLP).
Pooling and normalisation follow the folder's own modules, as ``encode`` applies them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omniflow.errors import InvalidArgument
from omniflow_services.worker.mm.nn import Weights, read_config

BERT_MODEL_TYPE = "bert"
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
# A BertLayer's linears (and LayerNorms), by the names the forward pass uses.
_BERT_LAYER = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "o": "attention.output.dense",
    "ln1": "attention.output.LayerNorm",
    "up": "intermediate.dense",
    "down": "output.dense",
    "ln2": "output.LayerNorm",
}


@dataclass(frozen=True, slots=True)
class Pooling:
    """How token states become one vector (sentence-transformers' ``Pooling`` modes, summed
    side by side when several are on) and whether it is L2-normalised after."""

    modes: tuple[str, ...] = ("mean_tokens",)
    normalize: bool = False


def read_pooling(folder: Path) -> Pooling:
    """The pooling of a sentence-transformers folder (mean pooling when it names none)."""
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return Pooling()
    modules: list[dict[str, Any]] = json.loads(modules_path.read_text())
    modes: tuple[str, ...] = ("mean_tokens",)
    normalize = False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            cfg_path = folder / str(m.get("path", "")) / "config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            modes = tuple(p for p in POOLING_MODES if cfg.get(f"pooling_mode_{p}"))
            if not modes:
                raise InvalidArgument(
                    f"{cfg_path} turns on no pooling mode; accepted: {', '.join(POOLING_MODES)}"
                )
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer", ""):
            raise InvalidArgument(
                f"{modules_path}: module {kind!r} is not served; accepted: Transformer, "
                "Pooling, Normalize"
            )
    return Pooling(modes, normalize)


def max_seq_length(folder: Path, max_positions: int) -> int:
    """``max_seq_length`` of ``sentence_bert_config.json``, capped by the position table."""
    path = folder / "sentence_bert_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    return min(int(cfg.get("max_seq_length") or max_positions), max_positions)


class BertEncoder:
    """BERT's encoder stack (float32 on ``device``) and the folder's pooling."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        c = read_config(folder, BERT_MODEL_TYPE)
        if c.get("position_embedding_type", "absolute") != "absolute":
            raise InvalidArgument(
                f"{folder}: position_embedding_type {c['position_embedding_type']!r}; "
                "accepted: absolute"
            )
        if c.get("hidden_act", "gelu") != "gelu":
            raise InvalidArgument(f"{folder}: hidden_act {c['hidden_act']!r}; accepted: gelu")
        w = Weights(folder, device)
        self.hidden = int(c["hidden_size"])
        self.heads = int(c["num_attention_heads"])
        self.eps = float(c.get("layer_norm_eps", 1e-12))
        self.vocab_size = int(c["vocab_size"])
        self.pad_id = int(c.get("pad_token_id") or 0)
        # A checkpoint saved from BertModel directly has no "bert." prefix; one saved from a
        # task head (BertForMaskedLM...) has it.
        try:
            w.take("embeddings.word_embeddings.weight")
            p = ""
        except InvalidArgument:
            p = "bert."
        self.word = w.take(f"{p}embeddings.word_embeddings.weight")
        self.pos = w.take(f"{p}embeddings.position_embeddings.weight")
        self.type0 = w.take(f"{p}embeddings.token_type_embeddings.weight")[0]
        self.emb_ln = w.linear(f"{p}embeddings.LayerNorm")
        self.layers = w.layers(f"{p}encoder.layer.", int(c["num_hidden_layers"]), _BERT_LAYER)
        self.max_len = max_seq_length(folder, self.pos.shape[0])
        self.pooling = read_pooling(folder)
        self.dim = self.hidden * len(self.pooling.modes)
        # Trained for shortened vectors (vLLM reads the same two config keys).
        self.matryoshka_dimensions = tuple(int(d) for d in c.get("matryoshka_dimensions") or ())
        self.matryoshka = bool(self.matryoshka_dimensions) or bool(c.get("is_matryoshka"))
        self.device = self.word.device

    def _ln(self, x: torch.Tensor, p: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden,), p[0], p[1], self.eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, -1).transpose(1, 2)

    @torch.inference_mode()
    def states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] (padded) and their mask [B, T] (1: real) → last states [B, T, H]."""
        b, t = ids.shape
        h = self._ln(self.word[ids] + self.pos[:t] + self.type0, self.emb_ln)
        # Padded keys are masked out; padded queries compute garbage that pooling ignores.
        keys = mask.bool()[:, None, None, :]
        for ly in self.layers:
            q, k, v = (self._heads(F.linear(h, *ly[n])) for n in ("q", "k", "v"))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
            a = a.transpose(1, 2).reshape(b, t, self.hidden)
            h = self._ln(h + F.linear(a, *ly["o"]), ly["ln1"])
            up = F.gelu(F.linear(h, *ly["up"]))
            h = self._ln(h + F.linear(up, *ly["down"]), ly["ln2"])
        return h

    @torch.inference_mode()
    def pool(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T, H] states → [B, dim] sentence vectors, as sentence-transformers pools."""
        m = mask.to(states.dtype)[:, :, None]
        counts = m.sum(1).clamp(min=1e-9)
        parts = []
        for mode in self.pooling.modes:
            if mode == "cls_token":
                parts.append(states[:, 0])
            elif mode == "max_tokens":
                parts.append(states.masked_fill(m == 0, -1e9).max(1).values)
            elif mode == "mean_tokens":
                parts.append((states * m).sum(1) / counts)
            else:  # mean_sqrt_len_tokens
                parts.append((states * m).sum(1) / counts.sqrt())
        out = torch.cat(parts, -1)
        return F.normalize(out, p=2, dim=1) if self.pooling.normalize else out

    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """Token id lists (each at most ``max_len``) → [len(batch), dim] float32 vectors."""
        longest = max(len(x) for x in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return self.pool(self.states(ids, mask), mask).float().cpu()
