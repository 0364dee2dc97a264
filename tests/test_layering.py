"""The import rule, in one line: library ← services, never the other way; a service reaches
another only through its gRPC API or a library module that owns the shared format.

An ``ast`` walk of every import statement (at module level or inside a function): nothing
in ``libs/omniflow`` imports ``omniflow_services``, and no service imports another
service's modules."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "libs" / "omniflow"
SERVICES = ROOT / "services"
SERVICE_NAMES = sorted(p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file())


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in one file; relative imports are
    resolved against the file's package (``services/x`` is ``omniflow_services.x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if path.is_relative_to(SERVICES):
        package = ["omniflow_services", *path.relative_to(SERVICES).parent.parts]
    else:
        package = ["omniflow", *path.relative_to(LIBRARY).parent.parts]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # ``from omniflow_services import router``
                yield node.lineno, f"{module}.{alias.name}"


def _py_files(tree: Path) -> list[Path]:
    return sorted(p for p in tree.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_walk_sees_imports_inside_functions() -> None:
    # The checker itself: an import inside a function is found too.
    sample = LIBRARY / "discovery" / "__init__.py"
    found = {m for _, m in imported_modules(sample)}
    assert "omniflow.discovery.redis_backend" in found  # imported inside make_registry
    assert "omniflow.discovery.base" in found
    found = {m for _, m in imported_modules(SERVICES / "router" / "server.py")}
    assert "omniflow_services.router.core" in found


def test_the_library_imports_no_service() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _py_files(LIBRARY)
        for line, module in imported_modules(path)
        if module == "omniflow_services" or module.startswith("omniflow_services.")
    ]
    assert not bad, "the library must not import a service:\n" + "\n".join(bad)


def test_the_library_imports_nothing_of_the_tests() -> None:
    # Test fixtures live under tests/ (procs, conftest...); omniflow.testing holds only
    # what a user runs too (the echo worker, the chaos harness), built on the library.
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests"}
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _py_files(LIBRARY)
        for line, module in imported_modules(path)
        if module.split(".")[0] in test_modules
    ]
    assert not bad, "the library must not import test code:\n" + "\n".join(bad)


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_a_service_imports_no_other_service(service: str) -> None:
    own = f"omniflow_services.{service}"
    bad = []
    for path in _py_files(SERVICES / service):
        for line, module in imported_modules(path):
            if not module.startswith("omniflow_services"):
                continue
            if module == "omniflow_services" or module == own or module.startswith(own + "."):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, (
        f"{service} reaches another service's modules (use its gRPC API, or move the shared "
        "format into the library):\n" + "\n".join(bad)
    )
