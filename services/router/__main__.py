"""`python -m omniflow_services.router` / `omniflow-router`."""

from __future__ import annotations

import sys

from omniflow.rpc.server import serve_main
from omniflow_services.router.config import RouterSettings
from omniflow_services.router.server import RouterApp


def main(argv: list[str] | None = None) -> int:
    return serve_main(RouterSettings, RouterApp, "Omni-Flow router", argv)


if __name__ == "__main__":
    sys.exit(main())
