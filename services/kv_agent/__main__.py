"""`python -m omniflow_services.kv_agent` / `omniflow-kv-agent`."""

from __future__ import annotations

import sys

from omniflow.rpc.server import serve_main
from omniflow_services.kv_agent.config import KVAgentSettings
from omniflow_services.kv_agent.server import KVAgentApp


def main(argv: list[str] | None = None) -> int:
    return serve_main(KVAgentSettings, KVAgentApp, "Omni-Flow node KV agent", argv)


if __name__ == "__main__":
    sys.exit(main())
