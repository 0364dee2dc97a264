"""The import rule, in one line: library ← services, never the other way; a service reaches
another only through its gRPC API or a library module that owns the shared format.

An ``ast`` walk of every import statement (at module level or inside a function): nothing
in ``libs/omniflow`` imports ``omniflow_services``, and no service imports another
service's modules. And no import circle, between files or between packages."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "libs" / "omniflow"
SERVICES = ROOT / "services"
SERVICE_NAMES = sorted(p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file())


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (never imported at run time)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def imported_modules(path: Path, run_time: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in one file; relative imports are
    resolved against the file's package (``services/x`` is ``omniflow_services.x``).
    ``run_time`` leaves out the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_only(tree) if run_time else set()
    if path.is_relative_to(SERVICES):
        package = ["omniflow_services", *path.relative_to(SERVICES).parent.parts]
    else:
        package = ["omniflow", *path.relative_to(LIBRARY).parent.parts]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
    assert "omniflow_services.router.metrics" in found


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


def _module_files() -> dict[str, Path]:
    """Every module of the library and the services by its import name (a package by its
    ``__init__.py``)."""
    found = {}
    for tree, top in ((LIBRARY, "omniflow"), (SERVICES, "omniflow_services")):
        for path in _py_files(tree):
            parts = [top, *path.relative_to(tree).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports at run time: line}, over the library and the services.
    ``from a import b`` counts ``a.b`` when that is a module, else ``a``."""
    files = _module_files()
    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for module, path in files.items():
        for line, target in imported_modules(path, run_time=True):
            if target in files and target != module:
                graph[module].setdefault(target, line)
    return graph


def circles(graph: dict[str, set[str]] | dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected sets of more than one node (Tarjan): each holds a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_of(module: str, files: dict[str, Path]) -> str:
    return module if files[module].name == "__init__.py" else module.rpartition(".")[0]


def package_graph() -> dict[str, set[str]]:
    """package -> packages its modules import, leaving out a package's own ancestors and
    descendants (a subpackage building on its parent's modules is layering, not a circle)."""
    files = _module_files()
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        a = _package_of(module, files)
        for target in targets:
            b = _package_of(target, files)
            if a == b or b.startswith(a + ".") or a.startswith(b + "."):
                continue
            graph.setdefault(a, set()).add(b)
    return graph


def _describe(group: set[str], graph: dict[str, dict[str, int]] | dict[str, set[str]]) -> str:
    return "\n".join(
        f"  {a} -> {b}" for a in sorted(group) for b in sorted(graph.get(a, ())) if b in group
    )


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(sorted(g) for g in circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_a_run_time_import_and_not_a_type_only_one() -> None:
    graph = import_graph()
    # A module-level import, and one inside a function (make_registry's backends).
    assert "omniflow.errors" in graph["omniflow.discovery.static_backend"]
    assert "omniflow.discovery.redis_backend" in graph["omniflow.discovery"]
    sample = SERVICES / "coordinator" / "adoption.py"  # its RunManager is a type only
    assert "omniflow_services.coordinator.runs" in {m for _, m in imported_modules(sample)}
    assert (
        "omniflow_services.coordinator.runs" not in graph["omniflow_services.coordinator.adoption"]
    )


def test_no_import_circle_between_files() -> None:
    graph = import_graph()
    bad = circles(graph)
    assert not bad, "import circles between modules:\n" + "\n".join(
        _describe(g, graph) for g in bad
    )


def test_no_import_circle_between_packages() -> None:
    graph = package_graph()
    bad = circles(graph)
    assert not bad, "import circles between packages:\n" + "\n".join(
        _describe(g, graph) for g in bad
    )


def test_the_arrows_between_service_modules_stay_inside_each_service(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from service_arrows import arrows, main

    found = arrows()
    assert ("services/router/server.py", "services/router/metrics.py") in found
    across = [f"{a} -> {b}" for a, b in found if Path(a).parts[1] != Path(b).parts[1]]
    assert not across, "arrows into another service:\n" + "\n".join(across)
    assert main(["router"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "services/router/server.py -> services/router/metrics.py" in printed
    assert all(line.startswith("services/router/") for line in printed)
