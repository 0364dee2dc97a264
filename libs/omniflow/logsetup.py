"""One logging setup for every service and CLI: standard library logger, one line per record."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)-7s %(service)s %(name)s: %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        return True


def setup_logging(service: str, level: str = "INFO") -> None:
    """Configure the root logger once: level, format with the service name, stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_ServiceFilter(service))
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Third-party chatter that drowns the service's own lines at INFO.
    for noisy in ("urllib3", "asyncio", "grpc._cython"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
