"""Every service's servicer is an ``omniflow.rpc.servicer.AppServicer``: the one place a
servicer is bound to its app, so no service writes that opening again.

An ``ast`` walk of ``services/``: each class with a generated ``*_pb2_grpc.*Servicer`` base
also names ``AppServicer["<its app>"]`` among its bases."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services"


def servicer_classes(tree: ast.AST) -> list[ast.ClassDef]:
    """The classes of a module with a base from a generated ``_pb2_grpc`` module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if (
                    isinstance(base, ast.Attribute)
                    and isinstance(base.value, ast.Name)
                    and base.value.id.endswith("_pb2_grpc")
                    and base.attr.endswith("Servicer")
                ):
                    found.append(node)
                    break
    return found


def app_servicer_base(node: ast.ClassDef) -> str | None:
    """The app ``AppServicer[...]`` is given among ``node``'s bases, or None."""
    for base in node.bases:
        if (
            isinstance(base, ast.Subscript)
            and isinstance(base.value, ast.Name)
            and base.value.id == "AppServicer"
        ):
            return ast.unparse(base.slice)
    return None


def test_the_walk_finds_a_servicer_without_the_base() -> None:
    tree = ast.parse(
        "class A(x_pb2_grpc.XServiceServicer):\n    pass\n"
        "class B(AppServicer['BApp'], y_pb2_grpc.YServiceServicer):\n    pass\n"
        "class C(Base):\n    pass\n"
    )
    classes = servicer_classes(tree)
    assert [c.name for c in classes] == ["A", "B"]
    assert [app_servicer_base(c) for c in classes] == [None, "'BApp'"]


def test_every_service_servicer_is_an_app_servicer() -> None:
    seen, missing = [], []
    for path in sorted(SERVICES.rglob("*.py")):
        for node in servicer_classes(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            seen.append(where)
            if app_servicer_base(node) is None:
                missing.append(where)
    # coordinator, kv-agent, kv-index, router (lookaside and proxy), worker
    assert len(seen) >= 6, seen
    assert not missing, f"servicers not built on omniflow.rpc.servicer.AppServicer: {missing}"
