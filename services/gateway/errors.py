"""The gateway's one error shape, the table from domain errors to HTTP statuses, and a JSON
body read into a request model (a bad body as OpenAI's 400)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from omniflow import errors


class APIError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, the offending param, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def the_one(names: list[str], param: str, message: str) -> str:
    """The single entry of ``names``; else a 400 on ``param`` whose ``message`` is formatted
    with ``count`` (how many there are) and ``names`` (comma-joined, or "none")."""
    if len(names) != 1:
        joined = ", ".join(names) or "none"
        raise bad_request(message.format(count=len(names), names=joined), param)
    return names[0]


# Domain error -> (HTTP status, OpenAI error type, code). The first matching class wins.
_TABLE: tuple[tuple[type[errors.OmniflowError], int, str, str], ...] = (
    (errors.InvalidArgument, 400, "invalid_request_error", "invalid_value"),
    (errors.Unimplemented, 400, "invalid_request_error", "unsupported"),
    (errors.FailedPrecondition, 400, "invalid_request_error", "failed_precondition"),
    (errors.NotFound, 404, "invalid_request_error", "model_not_found"),
    (errors.ResourceExhausted, 429, "rate_limit_error", "at_capacity"),
    (errors.Unavailable, 503, "service_unavailable", "no_worker"),
    (errors.DeadlineExceeded, 504, "timeout", "deadline_exceeded"),
    (errors.Cancelled, 499, "cancelled", "cancelled"),
)


def from_domain(exc: errors.OmniflowError) -> APIError:
    """The API error of a domain error (500 for anything not in the table)."""
    for cls, status, type_, code in _TABLE:
        if isinstance(exc, cls):
            # A sampling error names its field (omniflow.sampling.SamplingError).
            return APIError(status, str(exc), type_, getattr(exc, "field", None), code)
    return APIError(500, f"internal error: {exc}", "server_error", None, "internal")


_TAGS = ("image_url", "input_audio", "text")  # content part types named like their field


def _loc(loc: tuple[Any, ...]) -> str:
    out, prev = "", None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list", "function-after", "int") or "[" in str(part):
            continue  # pydantic's union-member labels: not a field of the request
        elif part == prev and part in _TAGS:
            continue  # a tagged union's tag ("image_url"), then its field of the same name
        else:
            out += f".{part}" if out else str(part)
        prev = part
    return out


def from_validation(exc: ValidationError) -> APIError:
    """A 400 naming the first bad field (``messages[0].role``) and what is accepted."""
    errs = exc.errors(include_url=False)
    # The deepest error: of a union (content: a string or parts), the member that got furthest.
    first = max(errs, key=lambda e: len(e.get("loc", ())))
    param = _loc(tuple(first.get("loc", ()))) or None
    if first.get("type") == "extra_forbidden":
        message = f"{param} is not supported by this server"
    else:
        message = f"{param}: {first.get('msg', 'invalid')}"
    if len(errs) > 1:
        message += f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})"
    return bad_request(message, param)


M = TypeVar("M", bound=BaseModel)


async def parse_json(request: Request, cls: type[M]) -> M:
    """The JSON body as ``cls``: OpenAI's 400 naming the bad field, or saying it is not JSON."""
    body = await request.body()
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise bad_request("the request body is not valid JSON") from None
        raise from_validation(exc) from None
