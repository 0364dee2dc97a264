"""A small fuzzer for the services' gRPC methods, driven by their descriptors.

Each request goes over a generic ``grpc.aio`` channel with identity serializers, so the
fuzzer sends bytes the client library would never produce: random bytes, mutations of
valid messages (flipped bytes, truncations, garbage after), hostile shapes (deep groups,
overlong varints), and well-formed messages whose fields hold extreme values (empty,
huge strings around a service's limits, negative/huge integers, NaN, unicode, thousands
of repeated entries). What counts is the status each call ends with: a client mistake
may be refused with any code but INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import descriptor as gdesc
from google.protobuf import message_factory
from google.protobuf.message import Message

from omniflow.rpc.client import MAX_MESSAGE_BYTES

#: Statuses that say "the server failed", never right for a malformed or extreme request.
#: (DATA_LOSS is not here: the agent answers it, documented, to a tensor whose bytes fail
#: the checksum its sender gave, as to corruption in transit.)
BAD = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
#: Requests per service: small in CI, ``OMNIFLOW_FUZZ_REQUESTS`` for a longer run.
DEFAULT_REQUESTS = 300
FD = gdesc.FieldDescriptor

_INT_EXTREMES = {
    FD.TYPE_INT32: (0, 1, -1, 2**31 - 1, -(2**31)),
    FD.TYPE_SINT32: (0, 1, -1, 2**31 - 1, -(2**31)),
    FD.TYPE_SFIXED32: (0, -1, 2**31 - 1, -(2**31)),
    FD.TYPE_INT64: (0, 1, -1, 2**63 - 1, -(2**63), 2**53 + 1),
    FD.TYPE_SINT64: (0, -1, 2**63 - 1, -(2**63)),
    FD.TYPE_SFIXED64: (0, -1, 2**63 - 1, -(2**63)),
    FD.TYPE_UINT32: (0, 1, 2**31, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 1, 2**32 - 1),
    FD.TYPE_UINT64: (0, 1, 2**63, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 1, 2**64 - 1),
}
_FLOATS = (0.0, -0.0, -1.0, 1e-45, 0.5, 2.0, 3.0e38, math.inf, -math.inf, math.nan)
_TEXTS = (
    "",
    " ",
    "\x00",
    "a\x00b",
    "héllo wörld",
    "日本語のテキスト",
    "\u202eevil\u202c",
    "😀" * 17,
    "../../../../etc/passwd",
    "/",
    "tiny:",
    "%s%s%n{0}{}",
    "\n\r\t" * 5,
    "DROP TABLE runs;--",
)


def fuzz_requests() -> int:
    return int(os.environ.get("OMNIFLOW_FUZZ_REQUESTS", DEFAULT_REQUESTS))


def rss_kb(pid: int) -> int:
    """Resident set size of ``pid`` from /proc, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Gen:
    """Extreme values for the fields of a message type. ``sizes`` are string/bytes lengths
    worth sending for this service (its limits and just past them): used rarely."""

    def __init__(self, rng: random.Random, sizes: Sequence[int] = ()) -> None:
        self.rng = rng
        self.sizes = tuple(sizes)
        self.big_left = 1  # big values per message: its size stays a few MiB at most

    def _big(self) -> bool:
        if self.big_left <= 0:
            return False
        self.big_left -= 1
        return True

    def text(self) -> str:
        r = self.rng.random()
        if r < 0.03 and self.sizes and self._big():
            return "x" * self.rng.choice(self.sizes)
        if r < 0.08 and self._big():
            return "y" * self.rng.choice((1024, 65536))
        if r < 0.55:
            return self.rng.choice(_TEXTS)
        n = self.rng.randint(1, 40)
        ranges = ((32, 126), (0xA0, 0xD7FF))  # ASCII and the BMP below the surrogates
        return "".join(chr(self.rng.randint(*self.rng.choice(ranges))) for _ in range(n))

    def blob(self) -> bytes:
        r = self.rng.random()
        if r < 0.03 and self.sizes and self._big():
            return self.rng.randbytes(self.rng.choice(self.sizes))
        return self.rng.randbytes(self.rng.choice((0, 1, 15, 16, 17, 32, 4096, 8192, 8193)))

    def scalar(self, f: gdesc.FieldDescriptor) -> object:
        t = f.type
        if t == FD.TYPE_STRING:
            return self.text()
        if t == FD.TYPE_BYTES:
            return self.blob()
        if t == FD.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return self.rng.choice(_FLOATS)
        if t == FD.TYPE_ENUM:
            known = [v.number for v in f.enum_type.values]
            return self.rng.choice([*known, -1, 99, 2**31 - 1])
        return self.rng.choice(_INT_EXTREMES[t])

    def fill(self, msg: Message, depth: int = 0) -> Message:
        for f in msg.DESCRIPTOR.fields:
            if self.rng.random() >= 0.35:  # else left unset
                self.set_field(msg, f, depth)
        return msg

    def set_field(self, msg: Message, f: gdesc.FieldDescriptor, depth: int) -> None:
        """Give field ``f`` of ``msg`` an extreme value (appending to a repeated one)."""
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            target = getattr(msg, f.name)
            key_f = f.message_type.fields_by_name["key"]
            val_f = f.message_type.fields_by_name["value"]
            for _ in range(self.rng.choice((0, 1, 3, 50))):
                key = self.scalar(key_f)
                if val_f.message_type is None:
                    target[key] = self.scalar(val_f)
                elif depth < 3:
                    self.fill(target[key], depth + 1)
        elif f.message_type is not None:
            if depth >= 3:
                return
            if f.is_repeated:
                for _ in range(self.rng.choice((0, 1, 2, 5, 40))):
                    self.fill(getattr(msg, f.name).add(), depth + 1)
            else:
                self.fill(getattr(msg, f.name), depth + 1)
                getattr(msg, f.name).SetInParent()
        elif f.is_repeated:
            n = self.rng.choice((0, 1, 3, 100, 5000))
            if n >= 100:  # many entries of one small value (bounded message size)
                small = self.rng.randbytes(16) if f.type == FD.TYPE_BYTES else None
                if f.type == FD.TYPE_STRING:
                    small = self.rng.choice(_TEXTS)
                getattr(msg, f.name).extend([self.scalar(f) if small is None else small] * n)
            else:
                getattr(msg, f.name).extend(self.scalar(f) for _ in range(n))
        else:
            try:
                setattr(msg, f.name, self.scalar(f))
            except (ValueError, TypeError):
                pass  # e.g. a closed enum rejects unknown numbers client-side

    def mutate(self, template: Message) -> bytes:
        """A valid request (``template``) with one or two fields, top-level or one level
        down, replaced by extreme values: reaches deeper than a message made at random."""
        self.big_left = 1
        msg = type(template)()
        msg.CopyFrom(template)
        for _ in range(self.rng.randint(1, 2)):
            target = msg
            fields = list(target.DESCRIPTOR.fields)
            if not fields:  # e.g. GetInfoRequest: only unknown fields can be added
                return msg.SerializeToString() + self.rng.randbytes(self.rng.randint(1, 32))
            f = self.rng.choice(fields)
            if f.message_type is not None and not f.is_repeated and self.rng.random() < 0.5:
                sub = getattr(target, f.name)
                if sub.DESCRIPTOR.fields and not f.message_type.GetOptions().map_entry:
                    target, f = sub, self.rng.choice(list(sub.DESCRIPTOR.fields))
            target.ClearField(f.name)
            self.set_field(target, f, 1)
        return msg.SerializeToString()

    def message_bytes(self, cls: type[Message]) -> bytes:
        self.big_left = 1
        return self.fill(cls()).SerializeToString()

    def raw(self, cls: type[Message]) -> bytes:
        """Bytes that are mostly not a valid message of ``cls``."""
        kind = self.rng.randrange(8)
        if kind == 0:
            return self.rng.randbytes(self.rng.randint(1, 512))
        if kind == 1:  # a valid message with bytes flipped
            data = bytearray(self.message_bytes(cls) or b"\x08\x01")
            for _ in range(self.rng.randint(1, 4)):
                data[self.rng.randrange(len(data))] = self.rng.randrange(256)
            return bytes(data)
        if kind == 2:  # truncated
            data = self.message_bytes(cls) or b"\x0a\x05abc"
            return data[: self.rng.randrange(len(data))] if len(data) > 1 else data
        if kind == 3:  # garbage after a valid message
            return self.message_bytes(cls) + self.rng.randbytes(self.rng.randint(1, 64))
        if kind == 4:  # deep nesting: start-group tags 5,000 deep
            return b"\x0b" * 5000
        if kind == 5:  # an overlong varint
            return b"\x08" + b"\xff" * 11
        if kind == 6:  # a length prefix far past the end
            return b"\x0a\xff\xff\xff\xff\x0fabc"
        return b""


@dataclass(slots=True)
class Tally:
    """What one service answered to the fuzz."""

    service: str
    sent: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    by_method: Counter[str] = field(default_factory=Counter)  # "Method CODE" -> count
    bad: list[str] = field(default_factory=list)  # "Method: CODE details", first few
    skipped: int = 0
    crashed: bool = False
    rss_before_kb: int = 0
    rss_after_kb: int = 0
    tracebacks: int = 0  # "Traceback" lines the fuzz added to the service's log
    bad_count: int = 0  # requests answered as a server failure (INTERNAL/UNKNOWN, HTTP 500)
    seconds: float = 0.0

    def record(self, method: str, code: str, details: str, bad: bool) -> None:
        self.sent += 1
        self.codes[code] += 1
        self.by_method[f"{method} {code}"] += 1
        if bad:
            self.bad_count += 1
            if len(self.bad) < 20:
                self.bad.append(f"{method}: {code} {details[:500]}")

    def row(self) -> dict[str, object]:
        return {
            "service": self.service,
            "sent": self.sent,
            "codes": dict(self.codes.most_common()),
            "crashed": self.crashed,
            "internal": self.bad_count,
            "rss_before_mb": round(self.rss_before_kb / 1024, 1),
            "rss_after_mb": round(self.rss_after_kb / 1024, 1),
            "tracebacks": self.tracebacks,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 1),
            "bad": self.bad,
            "by_method": dict(sorted(self.by_method.items())),
        }


#: (method name, serialized request) -> True to skip a request that is destructive by
#: design (an admin's "drop everything"), not a mistake.
Skip = Callable[[str, bytes], bool]


def _request_class(method: gdesc.MethodDescriptor) -> type[Message]:
    return message_factory.GetMessageClass(method.input_type)


#: Method name -> valid requests of it, for ``Gen.mutate``.
Templates = Mapping[str, Sequence[Message]]


def request(
    m: gdesc.MethodDescriptor,
    seed: int,
    sizes: Sequence[int] = (),
    templates: Templates | None = None,
) -> list[bytes]:
    """The messages of fuzz request ``seed`` to ``m`` (one, or 1-3 for a client stream):
    made when sent (never all held at once), the same for the same seed."""
    rng = random.Random(seed)
    gen = Gen(rng, sizes)
    cls = _request_class(m)
    valid = (templates or {}).get(m.name, ())
    n = rng.randint(1, 3) if m.client_streaming else 1
    out = []
    for i in range(n):
        r = rng.random()
        if valid and r < 0.45:  # a valid request with a field or two gone extreme
            out.append(gen.mutate(valid[i % len(valid)]))
        elif r < 0.7:  # not a valid message
            out.append(gen.raw(cls))
        else:  # valid, every field extreme
            out.append(gen.message_bytes(cls))
    return out


async def _call(
    channel: grpc.aio.Channel,
    sync: grpc.Channel,
    path: str,
    m: gdesc.MethodDescriptor,
    msgs: list[bytes],
    timeout_s: float,
) -> tuple[grpc.StatusCode, str]:
    try:
        if m.client_streaming and m.server_streaming:
            call = channel.stream_stream(path)(iter(msgs), timeout=timeout_s)
        elif m.client_streaming:
            # The sync API: an aio client that is still writing when the server ends the
            # call early reports INTERNAL "Internal error from Core" instead of the
            # server's status (grpc/grpc#36066); the sync client reports the server's.
            await asyncio.to_thread(sync.stream_unary(path), iter(msgs), timeout=timeout_s)
            return grpc.StatusCode.OK, ""
        elif m.server_streaming:
            call = channel.unary_stream(path)(msgs[0], timeout=timeout_s)
        else:
            await channel.unary_unary(path)(msgs[0], timeout=timeout_s)
            return grpc.StatusCode.OK, ""
        seen = 0
        async for _ in call:
            seen += 1
            if seen >= 2:  # a stream that runs: enough to know it serves; end it here
                call.cancel()
                return grpc.StatusCode.OK, "stream cut"
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    except grpc.RpcError as exc:  # the sync client's error is also a grpc.Call
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    except asyncio.CancelledError:
        return grpc.StatusCode.OK, "stream cut"


_RAW_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES * 2),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES * 2),
]


def open_raw(address: str) -> grpc.aio.Channel:
    """A plain channel that may send past the services' message limit."""
    return grpc.aio.insecure_channel(address, options=_RAW_OPTIONS)


async def fuzz(
    address: str,
    service: gdesc.ServiceDescriptor,
    tally: Tally,
    total: int,
    *,
    seed: int = 0,
    sizes: Sequence[int] = (),
    skip: Skip | None = None,
    templates: Templates | None = None,
    methods: Sequence[str] | None = None,
    concurrency: int = 8,
    timeout_s: float = 5.0,
    alive: Callable[[], bool] = lambda: True,
) -> None:
    """Send ``total`` fuzz requests to ``service`` at ``address`` into ``tally``; plus one
    message just past gRPC's own limit (must be refused, RESOURCE_EXHAUSTED)."""
    chosen = [m for m in service.methods if methods is None or m.name in methods]
    work = [(chosen[i % len(chosen)], seed * 1_000_003 + i) for i in range(total)]
    sem = asyncio.Semaphore(concurrency)
    started = time.monotonic()
    sync = grpc.insecure_channel(address, options=_RAW_OPTIONS)
    try:
        made = functools.partial(request, sizes=sizes, templates=templates)
        await _fuzz_on(open_raw(address), sync, service, tally, work, sem, made, skip, timeout_s)
    finally:
        sync.close()
    tally.seconds += time.monotonic() - started
    tally.crashed = tally.crashed or not alive()


async def _fuzz_on(
    aio: grpc.aio.Channel,
    sync: grpc.Channel,
    service: gdesc.ServiceDescriptor,
    tally: Tally,
    work: list[tuple[gdesc.MethodDescriptor, int]],
    sem: asyncio.Semaphore,
    made: Callable[[gdesc.MethodDescriptor, int], list[bytes]],
    skip: Skip | None,
    timeout_s: float,
) -> None:
    async with aio as channel:

        async def one(m: gdesc.MethodDescriptor, seed: int) -> None:
            async with sem:
                msgs = made(m, seed)
                if skip is not None and any(skip(m.name, b) for b in msgs):
                    tally.skipped += 1
                    return
                path = f"/{service.full_name}/{m.name}"
                code, details = await _call(channel, sync, path, m, msgs, timeout_s)
            if code in BAD:  # what was sent, to reproduce it
                sent = ", ".join(f"{len(b)} B {b[:24].hex()}" for b in msgs)
                details += f" <- request(seed={seed}): {sent}"
            tally.record(m.name, code.name, details, code in BAD)

        await asyncio.gather(*(one(m, seed) for m, seed in work))
        unary = next((m for m in service.methods if not m.client_streaming), service.methods[0])
        oversize = b"\x0a" + _varint(MAX_MESSAGE_BYTES + 1024) + b"z" * (MAX_MESSAGE_BYTES + 1024)
        path = f"/{service.full_name}/{unary.name}"
        code, details = await _call(channel, sync, path, unary, [oversize], 30.0)
        tally.record(unary.name, code.name, details, code in BAD)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def hangs(codes: dict[str, int]) -> int:
    """Requests that got no answer within the fuzz's deadline (a hang, not a refusal)."""
    return sum(n for c, n in codes.items() if c in ("timeout", "DEADLINE_EXCEEDED"))


def table(rows: Sequence[dict[str, object]]) -> str:
    """The fuzz table: one line per service."""
    head = (
        "service", "sent", "by status", "crashed", "INTERNAL/UNKNOWN (HTTP 5xx)", "hangs",
        "RSS MB before→after", "tracebacks", "seconds",
    )  # fmt: skip
    lines = [head]
    for r in rows:
        codes = ", ".join(f"{c} {n}" for c, n in dict(r["codes"]).items())  # type: ignore[call-overload]
        lines.append(
            (
                str(r["service"]),
                str(r["sent"]),
                codes,
                "yes" if r["crashed"] else "no",
                str(r["internal"]),
                str(hangs(dict(r["codes"]))),  # type: ignore[call-overload]
                f"{r['rss_before_mb']}→{r['rss_after_mb']}",
                str(r["tracebacks"]),
                str(r.get("seconds", "")),
            )
        )
    out = ["| " + " | ".join(cells) + " |" for cells in lines]
    out.insert(1, "|" + "---|" * len(head))
    return "\n".join(out)


def report(tally: Tally) -> None:
    """Print the service's row (visible with -s) and append it to OMNIFLOW_FUZZ_REPORT."""
    row = tally.row()
    print(f"\nfuzz {tally.service}: {json.dumps(row)}")
    path = os.environ.get("OMNIFLOW_FUZZ_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
