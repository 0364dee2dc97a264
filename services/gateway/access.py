"""The access log: one line per request, written once its response has been sent.

    POST /v1/chat/completions 200 tenant=local prompt_tokens=37 completion_tokens=8
    cached_tokens=0 ms=412.7 id=req-…

(one line in the log). The guard opens an :class:`Entry` when a request arrives and
writes it when the request is over; whatever makes the request's usage object
(``replies.usage``) notes its token counts in the open entry through a context variable,
so the handlers pass nothing around. Logger ``omniflow.gateway.access`` at INFO: raise its
level (``OMNIFLOW_LOG_LEVEL=WARNING``) to silence it. ``/health`` and ``/metrics`` (polled
by probes and Prometheus) are logged at DEBUG only.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass

log = logging.getLogger("omniflow.gateway.access")

QUIET_PATHS = ("/health", "/metrics")


@dataclass(slots=True)
class Entry:
    """One request's line, filled in as the request goes."""

    method: str
    path: str
    request_id: str
    tenant: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def line(self, status: int, ms: float) -> str:
        return (
            f"{self.method} {self.path} {status} tenant={self.tenant or '-'} "
            f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
            f"cached_tokens={self.cached_tokens} ms={ms:.1f} id={self.request_id}"
        )


_CURRENT: contextvars.ContextVar[Entry | None] = contextvars.ContextVar(
    "omniflow_gateway_access", default=None
)


def begin(entry: Entry) -> contextvars.Token[Entry | None]:
    """Open ``entry`` for the request being handled in this context."""
    return _CURRENT.set(entry)


def note_usage(prompt: int, cached: int, completion: int) -> None:
    """The request's token counts (the last usage made wins: it is the total)."""
    entry = _CURRENT.get()
    if entry is not None:
        entry.prompt_tokens, entry.cached_tokens, entry.completion_tokens = (
            prompt,
            cached,
            completion,
        )


def end(token: contextvars.Token[Entry | None], entry: Entry, status: int, ms: float) -> None:
    """Write ``entry``'s line and close it."""
    _CURRENT.reset(token)
    level = logging.DEBUG if entry.path in QUIET_PATHS else logging.INFO
    if log.isEnabledFor(level):
        log.log(level, "%s", entry.line(status, ms))
