"""Build a Hugging Face ``tokenizer.json`` from the tokenizer a GGUF file describes.

llama.cpp stores a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``) as its
token strings already spelled in GPT-2's byte alphabet, its merges as ``"a b"`` strings and a
type per token (1 normal, 3 control, 4 user-defined). The pre-tokenizer is named, not stored
(``tokenizer.ggml.pre``), so the split regex comes from a small table of families; any other
name gets GPT-2's byte-level split, as transformers' own GGUF loader does, so a converted
folder tokenizes like ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniflow.errors import InvalidArgument

CONTROL = 3
USER_DEFINED = 4

# The split regexes the Qwen2 and Llama-3 vocabularies were learned with (they differ in
# how many digits one piece may hold).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    """What a GGUF file says about its tokenizer (metadata keys already read)."""

    model: str
    pre: str | None
    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    special_ids: dict[str, int]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> GGUFTokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise InvalidArgument(
                f"tokenizer.ggml.model {model!r} is not supported; accepted: ['gpt2'] "
                f"(byte-level BPE, as Llama-3, Qwen2 and SmolLM files use)"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise InvalidArgument("GGUF file has no tokenizer.ggml.tokens/merges")
        return cls(
            model=model,
            pre=meta.get("tokenizer.ggml.pre"),
            tokens=list(tokens),
            merges=list(merges),
            token_types=list(meta.get("tokenizer.ggml.token_type") or []),
            special_ids={name: int(meta[key]) for name, key in _SPECIAL_IDS.items() if key in meta},
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def special_tokens(self) -> dict[str, str]:
        """``bos_token`` etc. as strings, for the ids the file names."""
        return {
            name: self.tokens[i]
            for name, i in self.special_ids.items()
            if 0 <= i < len(self.tokens)
        }


def build_tokenizer(info: GGUFTokenizer) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to the file's vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for i, token in enumerate(info.tokens):
        vocab.setdefault(token, i)
    merges: list[tuple[str, str]] = []
    for line in info.merges:
        left, sep, right = line.partition(" ")
        if not sep:
            raise InvalidArgument(f"GGUF merge {line!r} is not 'left right'")
        merges.append((left, right))
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = SPLITS.get(info.pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    types = info.token_types or [1] * len(info.tokens)
    # Control tokens stay whole and are special; one spelled outside the byte alphabet is a
    # mislabel in some files, and adding it would grow the vocabulary past the embeddings.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(info.tokens, types, strict=False)
        if kind == CONTROL and set(t) <= alphabet
    ]
    tok.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(info.tokens, types, strict=False)
        if kind == USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)
    specials = info.special_tokens()
    single, pair, used = "$A:0", "$A:0 $B:1", []
    if info.add_bos_token and "bos_token" in specials:
        bos = specials["bos_token"]
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        used.append((bos, info.special_ids["bos_token"]))
    if info.add_eos_token and "eos_token" in specials:
        eos = specials["eos_token"]
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        used.append((eos, info.special_ids["eos_token"]))
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(used))
    )
    return tok


def tokenizer_config(info: GGUFTokenizer, max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` contents: special tokens, BOS/EOS flags and the chat template."""
    specials = info.special_tokens()
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": info.add_bos_token,
        "add_eos_token": info.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        **specials,
    }
    if info.chat_template:
        cfg["chat_template"] = info.chat_template
    return cfg
