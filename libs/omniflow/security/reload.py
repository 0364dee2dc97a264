"""A table loaded from a file and loaded again when the file changes (tokens, API keys).

A token or key removed from its file must stop working without a restart. A server's
check calls :meth:`Reloading.current` on every request; it looks at the file's
``stat`` (modification time, size, inode: an atomic rename is a change) at most once per
``CHECK_S``, so a change is seen within that interval and a busy server costs one
``stat`` a second. A file that cannot be read or parsed while it is being rewritten
leaves the last good table in use (logged once per bad version); it is tried again at the
next check. A file that was removed is an empty table: nothing it granted works any more.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between two looks at the file (a removed token stops working within this).
CHECK_S = 1.0


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Reloading(Generic[T]):
    """``load(path)`` now (errors raise: a server must not start on a bad file), then
    again whenever the file changes."""

    def __init__(
        self,
        path: Path,
        load: Callable[[Path], T],
        empty: Callable[[], T],
        check_s: float = CHECK_S,
    ) -> None:
        self.path, self._load, self._empty, self.check_s = path, load, empty, check_s
        self._seen = _signature(path)
        self._value = load(path)
        self._next = time.monotonic() + check_s
        self._bad: tuple[int, int, int] | None = None
        self.reloads = 0

    def current(self) -> T:
        """The table as of the file's last good version (looked at once per check_s)."""
        now = time.monotonic()
        if now < self._next:
            return self._value
        self._next = now + self.check_s
        seen = _signature(self.path)
        if seen == self._seen:
            return self._value
        if seen is None:
            log.warning("%s was removed: it grants nothing until it is back", self.path)
            self._value, self._seen = self._empty(), None
            self.reloads += 1
            return self._value
        try:
            value = self._load(self.path)
        except (InvalidArgument, OSError) as exc:
            if seen != self._bad:
                log.error("%s changed but cannot be loaded (%s); keeping the last table",
                          self.path, exc)  # fmt: skip
                self._bad = seen
            return self._value
        self._value, self._seen, self._bad = value, seen, None
        self.reloads += 1
        log.info("reloaded %s", self.path)
        return self._value
