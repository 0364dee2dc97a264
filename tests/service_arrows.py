"""The arrows between service modules: which ``services/<svc>/`` module imports which (an
``ast`` walk of every import, at module level or inside a function, run-time ones only).

    python tests/service_arrows.py            # every service
    python tests/service_arrows.py worker     # one

One line per arrow, ``services/worker/server.py -> services/worker/core.py``; an arrow into
another service is printed with ``!!`` (tests/test_layering.py asserts there is none)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_layering import ROOT, SERVICE_NAMES, _module_files, import_graph

PREFIX = "omniflow_services."


def service_of(module: str) -> str:
    return module.removeprefix(PREFIX).split(".")[0]


def arrows(service: str | None = None) -> list[tuple[str, str]]:
    """(importing file, imported file) between service modules, sorted; of ``service`` only
    when given."""
    files = _module_files()
    out = []
    for module, targets in import_graph().items():
        if not module.startswith(PREFIX) or (service and service_of(module) != service):
            continue
        for target in targets:
            if target.startswith(PREFIX) and target != "omniflow_services":
                rel = (str(files[m].relative_to(ROOT)) for m in (module, target))
                out.append((next(rel), next(rel)))
    return sorted(out)


def main(argv: list[str]) -> int:
    wanted = argv[0] if argv else None
    if wanted is not None and wanted not in SERVICE_NAMES:
        print(f"no service {wanted!r}; services: {', '.join(SERVICE_NAMES)}", file=sys.stderr)
        return 2
    for src, dst in arrows(wanted):
        across = Path(src).parts[1] != Path(dst).parts[1]
        print(f"{src} {'!!' if across else '->'} {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
