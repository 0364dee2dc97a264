"""Turn a model setting into a folder: a path, or ``tiny:<arch>`` for a small random model
generated on first use (the single-machine default, since no weights can be downloaded)."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

TINY_PREFIX = "tiny:"
DEFAULT_MODELS_DIR = Path("~/.cache/omniflow/models")


def resolve_model(spec: str, models_dir: Path = DEFAULT_MODELS_DIR) -> Path:
    """The folder of ``spec``; generates ``tiny:<arch>`` under ``models_dir`` when missing.

    Several workers may start at once: one generates under a file lock, into a temporary
    folder renamed into place, and the others wait for it and reuse it.
    """
    if spec.startswith(TINY_PREFIX):
        from omniflow.models.tiny import ARCHS, make_tiny
        from omniflow.models.tiny_mm import MM_KINDS, make_tiny_kind

        arch = spec.removeprefix(TINY_PREFIX)
        if arch not in ARCHS + MM_KINDS:
            raise InvalidArgument(
                f"unknown tiny model {spec!r}; accepted: tiny:{', tiny:'.join(ARCHS + MM_KINDS)}"
            )
        root = models_dir.expanduser()
        root.mkdir(parents=True, exist_ok=True)
        target = root / f"tiny-{arch}"
        with open(root / f".tiny-{arch}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / "config.json").exists():
                tmp = root / f".tiny-{arch}.{os.getpid()}.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                log.info("generating %s into %s", spec, target)
                if arch in ARCHS:
                    make_tiny(arch, tmp)
                else:
                    make_tiny_kind(arch, tmp)
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
        return target
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidArgument(
            f"model {spec!r} is not a Hugging Face-format folder (no config.json there); "
            f"give a folder or tiny:<arch>"
        )
    return path
