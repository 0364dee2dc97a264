"""`python -m omniflow_services.gateway` / `omniflow-gateway`."""

from __future__ import annotations

import sys

from omniflow_services.gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
