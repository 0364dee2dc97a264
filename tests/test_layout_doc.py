"""docs/layout.md names every module of the library and the services, one line each, and
no module that is gone: the layout the README points to stays the one on disk."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "layout.md"
TREES = ("libs/omniflow", "services")


def documented() -> dict[str, str]:
    """Path (relative to the repository) -> its line's text, from the doc's tree."""
    text = DOC.read_text()
    block = text.split("```\n", 2)[1]
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    out: dict[str, str] = {}
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + name
        if name.endswith("/"):
            stack.append((indent, path))
        else:
            out[path] = line
    return out


def on_disk() -> set[str]:
    found = set()
    for tree in TREES:
        for p in (ROOT / tree).rglob("*.py"):
            rel = p.relative_to(ROOT)
            if "__pycache__" in rel.parts or rel.parts[:3] == ("libs", "omniflow", "api"):
                continue
            found.add(str(rel))
    return found


def test_the_tree_parses_to_real_paths() -> None:
    doc = documented()
    assert "libs/omniflow/rpc/status.py" in doc
    assert "services/worker/engine/model.py" in doc
    assert all(len(line.split(maxsplit=1)) == 2 for line in doc.values()), "a line says nothing"


def test_every_module_has_its_line_and_no_line_is_stale() -> None:
    doc = {p for p in documented() if p.startswith(TREES)}
    disk = on_disk()
    # __init__.py files may go unlisted (most hold only a docstring).
    missing = sorted(p for p in disk - doc if not p.endswith("__init__.py"))
    stale = sorted(doc - disk)
    assert not missing, f"add a line to docs/layout.md for: {missing}"
    assert not stale, f"docs/layout.md names modules that are gone: {stale}"
