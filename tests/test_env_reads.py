"""Every ``OMNIFLOW_*`` variable, and the ``OTEL_*`` and ``CONSUL_*`` ones the settings
declare, is read through ``omniflow.config`` (a declared setting, so it is in the README's
generated table): an ``ast`` walk of the library and the services finds no ``os.environ`` /
``os.getenv`` read of such a name outside ``config.py``.

Writing the environment (a child process's env, ``os.environ[...] = ...``, ``setdefault``
before a process reads its settings) is fine; so are the threading and transport variables
other libraries own (OMP_NUM_THREADS, UCX_NET_DEVICES), read as they define them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = (ROOT / "libs" / "omniflow", ROOT / "services")
CONFIG = ROOT / "libs" / "omniflow" / "config.py"
DECLARED = ("OMNIFLOW_", "OTEL_", "CONSUL_")  # the prefixes of the variables settings declare


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name)
    return isinstance(node, ast.Name) and node.id == "environ"


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (a variable's name kept in a constant)."""
    found = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            for target in stmt.targets:
                if isinstance(target, ast.Name) and isinstance(stmt.value.value, str):
                    found[target.id] = stmt.value.value
    return found


def environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) of every read of the environment in ``source``; ``"?"`` when the
    name is not a constant."""
    tree = ast.parse(source)
    names = _constants(tree)

    def key(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        return "?"

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if func.attr in ("get", "pop") and _is_environ(func.value):
                reads.append((node.lineno, key(node.args[0])))
            elif func.attr == "getenv" and isinstance(func.value, ast.Name):
                reads.append((node.lineno, key(node.args[0])))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value):
                reads.append((node.lineno, key(node.slice)))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            reads.append((node.lineno, key(node.left)))  # ``"X" in os.environ``
    return reads


def test_the_walk_finds_every_kind_of_read() -> None:
    source = (
        "import os\nVAR = 'OMNIFLOW_A'\n"
        "a = os.environ.get('OMNIFLOW_B', '')\nb = os.getenv(VAR)\n"
        "c = os.environ['OMNIFLOW_C']\nd = 'OMNIFLOW_D' in os.environ\n"
        "e = os.environ.get(name)\n"
        "os.environ['OMNIFLOW_W'] = '1'\nenv = {**os.environ, 'OMNIFLOW_X': '1'}\n"
        "os.environ.setdefault('OMNIFLOW_Y', '1')\n"
    )
    assert environment_reads(source) == [
        (3, "OMNIFLOW_B"),
        (4, "OMNIFLOW_A"),
        (5, "OMNIFLOW_C"),
        (6, "OMNIFLOW_D"),
        (7, "?"),
    ]


def test_no_omniflow_variable_is_read_outside_config() -> None:
    bad = []
    for tree in TREES:
        for path in sorted(tree.rglob("*.py")):
            if path == CONFIG or "__pycache__" in path.parts or "api" in path.parts:
                continue
            for line, name in environment_reads(path.read_text()):
                if name.startswith(DECLARED) or name == "?":
                    bad.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert not bad, (
        "read these through omniflow.config (declare a setting; it joins the README's "
        "table):\n" + "\n".join(bad)
    )
