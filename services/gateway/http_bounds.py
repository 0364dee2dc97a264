"""Bounds on what one HTTP connection can make the gateway hold, below the ASGI app.

uvicorn's httptools protocol reads headers of any size and waits for a request or a body
for ever; ``bounded_protocol`` gives it, per connection:

- a header bound: past ``max_header_bytes`` of request line and headers, 431 and close,
  before the guard hashes a key or the app sees the request;
- a header deadline: the request line and headers within ``header_timeout_s`` of the
  connection's opening (or of its next request's first byte), else 408 and close: a
  client sending a byte a second (slowloris) holds nothing for long;
- a body deadline: the whole body within ``body_timeout_s`` of the headers, else 408 (when
  no response started) and close.

Idle kept-alive connections are closed by uvicorn's own ``timeout_keep_alive``, and
connections past ``limit_concurrency`` get its 503 (``server.py`` sets both).
"""

from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float


def _response(status: int, message: str, code: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    phrase = http.HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class _Bounded(HttpToolsProtocol):
    limits: HttpLimits  # set on the subclass ``bounded_protocol`` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._in_head = True  # the bytes that arrive now belong to a request's head
        self._tail = b""  # the last bytes of the head so far (a split "\r\n\r\n")
        self._timer: asyncio.TimerHandle | None = None
        self._arm(body=False)

    def _arm(self, *, body: bool) -> None:
        """Start the header deadline, or the body's (``body``), in place of the one running."""
        if self._timer is not None:
            self._timer.cancel()
        delay = self.limits.body_timeout_s if body else self.limits.header_timeout_s
        self._timer = self.loop.call_later(delay, self._late, body, delay)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # refused: nothing more is parsed
        if self._in_head:
            # Counted before the parser sees it: a head past the bound never reaches the app.
            window = self._tail + data
            end = window.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(end + 4 - len(self._tail), 0)
            self._tail = window[-3:]
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(
                    431,
                    "request line and headers are larger than "
                    f"{self.limits.max_header_bytes} bytes (OMNIFLOW_GATEWAY_MAX_HEADER_BYTES)",
                    "request_header_fields_too_large",
                )
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._timer is None:  # a kept-alive connection's next request
            self._arm(body=False)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = False, 0, b""
        self._arm(body=True)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True  # what comes next is the next request's head
        super().on_message_complete()

    def _late(self, body: bool, delay: float) -> None:
        self._timer = None
        what = (
            f"request body not received within {delay:g} s of its headers "
            "(OMNIFLOW_GATEWAY_BODY_TIMEOUT_S)"
            if body
            else f"request headers not received within {delay:g} s "
            "(OMNIFLOW_GATEWAY_HEADER_TIMEOUT_S)"
        )
        self._refuse(408, what, "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(_response(status, message, code))
        self.transport.close()  # connection_lost tells a waiting app it disconnected


def bounded_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class with ``limits`` (give it as ``Config(http=...)``)."""
    return type("BoundedHttpToolsProtocol", (_Bounded,), {"limits": limits})
