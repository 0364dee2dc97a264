"""Load workflows from a Python file written with the DSL (for the CLI)."""

from __future__ import annotations

import runpy
from pathlib import Path

from omniflow.dsl.builder import Workflow
from omniflow.errors import InvalidArgument


def load_workflows(path: str | Path) -> list[Workflow]:
    """Every :class:`Workflow` the file defines at module level (or lists in ``WORKFLOWS``)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(f"{path}: no such workflow file")
    try:
        namespace = runpy.run_path(str(path), run_name="omniflow_workflow")
    except InvalidArgument as exc:
        raise InvalidArgument(f"{path}: {exc}") from None
    found = namespace.get("WORKFLOWS")
    if found is None:
        found = [v for v in namespace.values() if isinstance(v, Workflow)]
    workflows = [w for w in found if isinstance(w, Workflow)]
    if not workflows:
        raise InvalidArgument(f"{path} defines no Workflow (at module level or in WORKFLOWS)")
    return workflows
