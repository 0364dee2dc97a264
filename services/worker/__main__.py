"""`python -m omniflow_services.worker` / `omniflow-worker`."""

from __future__ import annotations

import sys

from omniflow.rpc.server import serve_main
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.server import WorkerApp


def main(argv: list[str] | None = None) -> int:
    return serve_main(WorkerSettings, WorkerApp, "Omni-Flow compute worker", argv)


if __name__ == "__main__":
    sys.exit(main())
