"""Malformed and extreme HTTP requests for the gateway's OpenAI API.

Bodies: random bytes, broken JSON (truncated, deeply nested, NaN, huge numbers, the wrong
top-level type), and JSON objects of the API's own fields holding wrong types and extreme
values; sizes just under and just past the body limit; odd headers. Any status but 500
is an answer to a client mistake (401, 404, 405, 413, 415, 422, 429, 400, and 503 when a
role has no worker are all right).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
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


class BodyGen:
    def __init__(self, rng: random.Random, model: str, max_body: int) -> None:
        self.rng, self.model, self.max_body = rng, model, max_body

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
    seed: int = 0,
    concurrency: int = 4,
    timeout_s: float = 10.0,
) -> None:
    """Send ``total`` malformed/extreme requests; statuses into ``tally`` (500 is bad)."""
    rng = random.Random(seed)
    gen = BodyGen(rng, model, max_body)
    sem = asyncio.Semaphore(concurrency)
    started = time.monotonic()
    plan: list[tuple[str, str, bytes, dict[str, str]]] = []
    for _ in range(total):
        method, path = rng.choice(ROUTES)
        path = path.replace("{junk}", rng.choice(("x", "%00", "..%2f..%2fetc", "a" * 4000)))
        body, ctype = gen.body() if method == "POST" else (b"", "")
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
