"""The llm engines of the worker stand side by side on one interface (``worker/llm``).

The built-in engine (``engine/``), the vLLM backend (``vllm/``), the SGLang backend
(``sglang/``) and the echo test engine (``echo/``) implement ``llm.role.LLMRole`` over the
types of ``llm.types``; none of them reaches another, directly or through a module in
between, and no two files under ``services/worker`` import each other in a circle. An
``ast`` walk of the run-time imports (``if TYPE_CHECKING:`` blocks left out; ``from a import
b`` counts ``a.b`` when that is a module, else ``a``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "services" / "worker"
PREFIX = "omniflow_services.worker"
ENGINES = ("engine", "vllm", "sglang", "echo")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(WORKER.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = [PREFIX, *path.relative_to(WORKER).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _run_time_imports(path: Path, module: str, is_package: bool) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def worker_graph() -> dict[str, set[str]]:
    """module -> the worker modules it imports at run time."""
    files = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = _run_time_imports(path, module, path.name == "__init__.py")
        named = {t for t in targets if t in files}
        # ``from a import b`` with b a module is an edge to b only, not to a as well.
        graph[module] = {
            t for t in named if not any(u.startswith(t + ".") and u in named for u in targets)
        } - {module}
    return graph


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def engine_of(module: str) -> str | None:
    part = module.removeprefix(PREFIX + ".").split(".")[0]
    return part if part in ENGINES else None


def test_the_walk_sees_the_edges_it_must() -> None:
    graph = worker_graph()
    assert f"{PREFIX}.llm.types" in graph[f"{PREFIX}.engine.engine"]
    assert f"{PREFIX}.engine.kernels" in graph[f"{PREFIX}.engine.model"]
    # The package __init__ is not an edge of ``import a.b.c as c``.
    assert f"{PREFIX}.engine" not in graph[f"{PREFIX}.engine.model"]
    # An engine reaching another through a module in between is found.
    fake = {"a.vllm.x": {"a.kv"}, "a.kv": {"a.engine"}}
    assert "a.engine" in reach(fake, "a.vllm.x")


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_reaches_no_other_engine(engine: str) -> None:
    graph = worker_graph()
    bad = sorted(
        f"{module} reaches {other}"
        for module in graph
        if engine_of(module) == engine
        for other in reach(graph, module)
        if engine_of(other) not in (None, engine)
    )
    assert not bad, "llm engines must meet only on worker/llm:\n" + "\n".join(bad[:20])


def test_the_interface_package_reaches_no_engine() -> None:
    graph = worker_graph()
    bad = sorted(
        f"{module} reaches {other}"
        for module in graph
        if module.startswith(f"{PREFIX}.llm")
        for other in reach(graph, module)
        if engine_of(other) is not None
    )
    assert not bad, "\n".join(bad[:20])


def test_no_import_circle_between_worker_files() -> None:
    graph = worker_graph()
    bad = sorted(m for m in graph if m in reach(graph, m))
    assert not bad, "modules of the worker that import themselves through others:\n" + (
        "\n".join(f"  {m} -> {sorted(graph[m] & set(bad))}" for m in bad)
    )


def test_the_echo_engine_path_imports_no_torch() -> None:
    # The echo worker starts in tests and benches by the dozen: its edge, core and engine
    # must stay light (no torch, no model code).
    code = (
        "import sys\n"
        "import omniflow_services.worker.server, omniflow_services.worker.echo.role\n"
        "import omniflow_services.worker.echo.edge\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "torch" not in out.stdout, out.stdout
