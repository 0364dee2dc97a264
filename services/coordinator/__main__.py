"""`python -m omniflow_services.coordinator` / `omniflow-coordinator`."""

from __future__ import annotations

import sys

from omniflow.rpc.server import serve_main
from omniflow_services.coordinator.config import CoordinatorSettings
from omniflow_services.coordinator.server import CoordinatorApp


def main(argv: list[str] | None = None) -> int:
    return serve_main(CoordinatorSettings, CoordinatorApp, "Omni-Flow coordinator", argv)


if __name__ == "__main__":
    sys.exit(main())
