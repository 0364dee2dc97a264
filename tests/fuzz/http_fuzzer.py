"""Malformed and extreme HTTP requests for the gateway's OpenAI API.

Bodies: random bytes, broken JSON (truncated, deeply nested, NaN, huge numbers, the wrong
top-level type), and JSON objects of the API's own fields holding wrong types and extreme
values; per route, near-valid requests of the newer endpoints (embeddings, tokenize and
detokenize, tool calls and tool_choice, response_format and structured_outputs, multipart
audio uploads with real, truncated and junk WAV files and wrong form fields); sizes just
under and just past the body limit; odd headers. Any status but 500
is an answer to a client mistake (401, 404, 405, 413, 415, 422, 429, 400, and 503 when a
role has no worker are all right).
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
import struct
import time
import wave
from collections.abc import Sequence
from typing import Any

import httpx
from fuzzer import Tally

ROUTES = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/audio/speech"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{junk}"),
    ("GET", "/health"),
    ("DELETE", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/openapi.json"),
)
_FIELDS = (
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "n", "stream", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "stream_options", "response_format", "tools",
    "size", "input", "voice", "response_format", "speed", "echo", "suffix", "best_of",
    "encoding_format", "dimensions", "tokens", "add_special_tokens", "return_token_strs",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    "structured_outputs", "tool_choice", "parallel_tool_calls",
)  # fmt: skip


_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _wav(rng: random.Random, seconds: float) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rng.choice((16_000, 8_000, 44_100)))
        w.writeframes(rng.randbytes(int(16_000 * seconds) * 2))
    return out.getvalue()


class BodyGen:
    def __init__(
        self, rng: random.Random, model: str, max_body: int, models: Sequence[str] = ()
    ) -> None:
        self.rng, self.model, self.max_body = rng, model, max_body
        self.models = [*models] or [model]

    def pick_model(self) -> str:
        return self.rng.choice((*self.models, self.model, "nope", ""))

    def for_route(self, path: str) -> tuple[bytes, str] | None:
        """A near-valid request of ``path``'s own shape with a field gone wrong (None: no
        template for the route)."""
        rng, value = self.rng, self.value
        body: dict[str, Any]
        if path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            return self.upload()
        if path == "/v1/embeddings":
            body = {"model": self.pick_model(), "input": rng.choice(
                ("hi", ["a", "b"], [[1, 2, 3]], [5, 6], "", [], ["x" * 5000] * 3, [[]], 7)
            )}  # fmt: skip
            if rng.random() < 0.5:
                body["encoding_format"] = rng.choice(("float", "base64", "nope", 3, None))
            if rng.random() < 0.5:
                body["dimensions"] = rng.choice((1, 8, 0, -1, 10**9, "8", 2.5))
        elif path in ("/tokenize", "/detokenize"):
            body = {"model": self.pick_model()}
            if path == "/detokenize":
                body["tokens"] = rng.choice(([1, 2, 3], [-1], [2**40], ["a"], [], None, "1 2"))
            elif rng.random() < 0.5:
                body["prompt"] = rng.choice(("hello", "", "😀" * 100, 5, ["a"]))
            else:
                body["messages"] = value() if rng.random() < 0.3 else [
                    {"role": "user", "content": "hi"}
                ]  # fmt: skip
                body["add_generation_prompt"] = rng.choice((True, False, "yes"))
            for name in ("add_special_tokens", "return_token_strs"):
                if rng.random() < 0.3:
                    body[name] = value()
        elif path == "/v1/chat/completions" and rng.random() < 0.7:
            body = {"model": self.model, "messages": [{"role": "user", "content": "weather?"}],
                    "max_tokens": rng.choice((1, 4, 16))}  # fmt: skip
            if rng.random() < 0.5:
                body["tools"] = rng.choice(
                    ([_TOOL], [_TOOL, _TOOL], [{"type": "function"}], [{"type": "nope"}],
                     [{"type": "function", "function": {"name": "f", "parameters": "x"}}], [], {})
                )  # fmt: skip
                body["tool_choice"] = rng.choice(
                    ("auto", "none", "required", "any", None, 7,
                     {"type": "function", "function": {"name": "get_weather"}},
                     {"type": "function", "function": {"name": "nope"}})
                )  # fmt: skip
                if rng.random() < 0.3:
                    body["parallel_tool_calls"] = value()
                if rng.random() < 0.3:  # a history with a call and its (junk) result
                    call = {
                        "id": "c1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": rng.choice(('{"city":"x"}', "{", 7)),
                        },
                    }
                    body["messages"] += [
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": rng.choice(("c1", "zz", 5)),
                         "content": rng.choice(("sunny", None, [], "x" * 3000))},
                    ]  # fmt: skip
            else:
                body["response_format"] = rng.choice(
                    ({"type": "json_object"}, {"type": "text"}, {"type": "nope"}, "json",
                     {"type": "json_schema", "json_schema": {"name": "s", "schema": _SCHEMA}},
                     {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
                     {"type": "json_schema", "json_schema": {"name": "s", "schema": True}},
                     {"type": "json_schema"})
                )  # fmt: skip
                if rng.random() < 0.3:
                    body["structured_outputs"] = rng.choice(
                        ({"regex": "["}, {"regex": "[a-z]+"}, {"choice": []}, {"choice": ["a", 1]},
                         {"grammar": "root ::= "}, {"json": _SCHEMA}, {"json": "{"}, 7)
                    )  # fmt: skip
            if rng.random() < 0.3:
                body["stream"] = True
        else:
            return None
        return json.dumps(body, allow_nan=True).encode(), "application/json"

    def upload(self) -> tuple[bytes, str]:
        """A multipart upload: a WAV (real, truncated, junk or empty) and form fields."""
        rng = self.rng
        boundary = f"fuzz{rng.getrandbits(48):x}"
        fields = {"model": self.pick_model()}
        for name, choices in (
            ("response_format", ("json", "text", "verbose_json", "srt", "vtt", "nope")),
            ("temperature", ("0", "0.4", "-1", "x", "1e999", "nan")),
            ("language", ("en", "xx", "", "e" * 300)),
            ("prompt", ("hello", "z" * 20_000)),
            ("timestamp_granularities[]", ("word", "segment", "nope")),
            ("stream", ("true", "false", "2")),
        ):
            if rng.random() < 0.4:
                fields[name] = rng.choice(choices)
        wav = _wav(rng, rng.choice((0.1, 0.5)))
        data = rng.choice((
            wav, wav[: rng.randrange(1, 44)], b"", rng.randbytes(2000),
            b"RIFF" + struct.pack("<I", 2**32 - 1) + b"WAVEfmt " + rng.randbytes(40),
        ))  # fmt: skip
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
            for k, v in fields.items()
        ]
        if rng.random() < 0.9:  # sometimes no file at all
            name = rng.choice(("file", "file", "audio"))
            head = (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                    f'filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n')  # fmt: skip
            parts.append(head.encode() + data + b"\r\n")
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        if rng.random() < 0.1:
            body = body[: rng.randrange(1, len(body))]  # cut short
        return body, f"multipart/form-data; boundary={boundary}"

    def value(self, depth: int = 0) -> Any:
        r = self.rng.randrange(14)
        if r == 0:
            return None
        if r == 1:
            return self.rng.choice((0, -1, 1, 2**31, 2**63, -(2**63), 10**400))
        if r == 2:
            return self.rng.choice((0.0, -1.5, 1e308, math.inf, -math.inf, math.nan))
        if r == 3:
            return self.rng.random() < 0.5
        if r == 4:
            return self.rng.choice(("", "😀" * 50, "\x00", "a" * 10_000, self.model, "tiny:"))
        if r == 5 and depth < 3:
            return [self.value(depth + 1) for _ in range(self.rng.choice((0, 1, 3, 200)))]
        if r == 6 and depth < 3:
            return {self.rng.choice(_FIELDS): self.value(depth + 1) for _ in range(3)}
        if r == 7:  # a plausible chat message with a wrong part
            role = self.rng.choice(("user", "system", "assistant", "tool", "nobody", 7))
            content: Any = self.rng.choice(
                (
                    "hi",
                    [{"type": "text", "text": "hi"}],
                    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                    [{"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}}],
                    [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}],
                    [{"type": "nope"}],
                    None,
                )
            )
            return [{"role": role, "content": content}]
        if r == 8:
            return [self.rng.randrange(-5, 200_000) for _ in range(self.rng.choice((1, 50)))]
        return self.rng.choice(("hello", 8, 0.0, [], {}, "stream"))

    def json_object(self) -> dict[str, Any]:
        if self.rng.random() < 0.5:  # a valid request with a field or two gone extreme
            body: dict[str, Any] = self.rng.choice(
                (
                    {"model": self.model, "prompt": "hi there", "max_tokens": 4},
                    {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 4},
                    {"model": self.model, "prompt": "hi", "max_tokens": 4, "stream": True},
                )
            )  # fmt: skip
            for _ in range(self.rng.randint(1, 2)):
                body[self.rng.choice(_FIELDS)] = self.value()
            return body
        body = {"model": self.model} if self.rng.random() < 0.7 else {}
        for _ in range(self.rng.randint(0, 6)):
            body[self.rng.choice(_FIELDS)] = self.value()
        if "max_tokens" not in body:  # keep generations that do run short
            body["max_tokens"] = self.rng.choice((1, 4))
        return body

    def body(self) -> tuple[bytes, str]:
        """(body, content type)."""
        kind = self.rng.randrange(12)
        ctype = "application/json"
        if kind == 0:
            return self.rng.randbytes(self.rng.randint(0, 2048)), ctype
        if kind == 1:  # truncated valid JSON
            text = json.dumps(self.json_object())
            return text[: self.rng.randrange(max(1, len(text)))].encode(), ctype
        if kind == 2:  # deeply nested
            depth = self.rng.choice((1000, 100_000))
            return ("[" * depth + "]" * depth).encode(), ctype
        if kind == 3:
            return self.rng.choice((b"null", b"[]", b'"x"', b"1e999999", b"{}", b"", b"{,}")), ctype
        if kind == 4:  # just under / just past the body limit
            size = self.max_body + self.rng.choice((-64, 1, 4096))
            pad = max(0, size - 60)
            return json.dumps({"model": self.model, "prompt": "z" * pad}).encode(), ctype
        if kind == 5:
            return json.dumps(self.json_object()).encode(), self.rng.choice(
                ("text/plain", "", "application/x-www-form-urlencoded", "multipart/form-data")
            )
        if kind == 6:  # invalid UTF-8 inside a string
            return b'{"model": "' + self.model.encode() + b'", "prompt": "\xff\xfe\xc3"}', ctype
        # allow_nan: NaN and Infinity literals, which Python's json reads
        return json.dumps(self.json_object(), allow_nan=True).encode(), ctype


async def fuzz_http(
    base_url: str,
    tally: Tally,
    total: int,
    *,
    model: str,
    max_body: int,
    api_key: str = "",
    models: Sequence[str] = (),
    seed: int = 0,
    concurrency: int = 4,
    timeout_s: float = 10.0,
) -> None:
    """Send ``total`` malformed/extreme requests; statuses into ``tally`` (500 is bad)."""
    rng = random.Random(seed)
    gen = BodyGen(rng, model, max_body, models)
    sem = asyncio.Semaphore(concurrency)
    started = time.monotonic()
    plan: list[tuple[str, str, bytes, dict[str, str]]] = []
    for _ in range(total):
        method, path = rng.choice(ROUTES)
        path = path.replace("{junk}", rng.choice(("x", "%00", "..%2f..%2fetc", "a" * 4000)))
        shaped = gen.for_route(path) if method == "POST" and rng.random() < 0.5 else None
        body, ctype = shaped or (gen.body() if method == "POST" else (b"", ""))
        headers = {"content-type": ctype} if ctype else {}
        if api_key and rng.random() < 0.9:
            headers["authorization"] = rng.choice(
                (f"Bearer {api_key}",) * 4 + ("Bearer wrong", "Basic Zm9v", "Bearer ")
            )
        plan.append((method, path, body, headers))

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as http:

        async def one(method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
            async with sem:
                try:
                    async with http.stream(method, path, content=body, headers=headers) as resp:
                        read = 0
                        async for piece in resp.aiter_bytes():
                            read += len(piece)
                            if read > 4096:  # a stream that runs: enough to know it serves
                                break
                        code = str(resp.status_code)
                except httpx.TimeoutException:
                    code = "timeout"
                except httpx.TransportError as exc:
                    code = f"transport:{type(exc).__name__}"
            bad = code == "500" or code.startswith("transport")
            detail = f"{method} {path} {len(body)} B {body[:80]!r}" if bad else ""
            tally.record(f"{method} {path[:40]}", code, detail, bad)

        await asyncio.gather(*(one(*p) for p in plan))
    tally.seconds += time.monotonic() - started
