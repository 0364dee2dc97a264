"""`python -m omniflow_services.kv_index` / `omniflow-kv-index`."""

from __future__ import annotations

import sys

from omniflow.rpc.server import serve_main
from omniflow_services.kv_index.config import KVIndexSettings
from omniflow_services.kv_index.server import KVIndexApp


def main(argv: list[str] | None = None) -> int:
    return serve_main(KVIndexSettings, KVIndexApp, "Omni-Flow KV index", argv)


if __name__ == "__main__":
    sys.exit(main())
