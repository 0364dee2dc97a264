"""What a chat or completion request constrains its answer to, as one ``StructuredOutput``
(``omniflow.sampling``), and the request field that said so (errors name it).

- ``response_format: {"type": "json_object"}``: any JSON object; ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``: JSON valid against ``schema``
  (``strict`` or not: the grammar always enforces the schema, as vLLM does).
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or its
  text), ``regex``, ``choice`` (a list of strings), ``grammar`` (xgrammar's EBNF) and
  ``json_object: true``.
- A forced tool choice (``tool_choice`` ``required`` or a named function) constrains the
  answer too (``tool_calls.py``); it cannot be combined with either of the above.

The worker compiles the constraint; one that does not compile is a 400 naming the field
(:func:`name_field`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from omniflow.errors import InvalidArgument, OmniflowError
from omniflow.sampling import StructuredOutput
from omniflow_services.gateway.errors import APIError, bad_request, from_domain, the_one
from omniflow_services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StructuredOutputs,
)

SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's constraint and the field it came from (``response_format``,
    ``structured_outputs.regex``, ``tool_choice``)."""

    structured: StructuredOutput
    param: str


def constraint_of(req: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
    """The constraint ``response_format`` or ``structured_outputs`` asks for; None: free text."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(Constraint(StructuredOutput("json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        if js is None or js.schema_ is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema (a JSON schema)",
                "response_format.json_schema",
            )
        found.append(
            Constraint(StructuredOutput("json", json.dumps(js.schema_)), "response_format")
        )
    if req.structured_outputs is not None:
        found.append(_of_structured_outputs(req.structured_outputs))
    if len(found) > 1:
        raise bad_request(
            "response_format and structured_outputs both constrain the answer: set one",
            "structured_outputs",
        )
    if not found:
        return None
    c = found[0]
    try:
        c.structured.validate(c.param)
    except InvalidArgument as exc:
        raise bad_request(str(exc), c.param) from None
    return c


def _of_structured_outputs(so: StructuredOutputs) -> Constraint:
    given = {
        "json": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object or None,
    }
    kind = the_one(
        [k for k, v in given.items() if v is not None],
        "structured_outputs",
        f"structured_outputs takes exactly one of {', '.join(SO_KINDS)}; got {{names}}",
    )
    value = given[kind]
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        return Constraint(StructuredOutput("json_object"), param)
    if kind == "json":
        spec = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        spec = json.dumps(value)
    else:
        spec = str(value)
    return Constraint(StructuredOutput(kind, spec), param)


def name_field(exc: OmniflowError, constraint: Constraint | None) -> APIError:
    """The API error of a worker's refusal, naming the request field when it was the
    constraint that did not compile (the worker names it ``structured.<kind>``)."""
    err = from_domain(exc)
    if constraint is not None and err.status == 400 and "structured." in err.message:
        kind = constraint.structured.kind
        err.message = err.message.replace(f"structured.{kind}", constraint.param, 1)
        err.param = constraint.param
    return err


async def naming(constraint: Constraint | None, work: Awaitable[T]) -> T:
    """``work``, with a worker's refusal of the constraint naming the request's field."""
    try:
        return await work
    except OmniflowError as exc:
        if constraint is None:
            raise
        raise name_field(exc, constraint) from None


async def primed(
    events: AsyncIterator[bytes], count: int, constraint: Constraint
) -> AsyncIterator[bytes]:
    """``events`` with its first ``count`` items already taken, so that a constraint the
    worker refuses is the response's 400, not an error event after a 200 (a chat stream's
    role chunks come joined to its first worker chunk: ``replies.joined``)."""
    first: list[bytes] = []
    try:
        for _ in range(count):
            first.append(await anext(events))
    except StopAsyncIteration:
        pass
    except OmniflowError as exc:
        await events.aclose()
        raise name_field(exc, constraint) from None
    except BaseException:
        await events.aclose()
        raise

    async def rest() -> AsyncIterator[bytes]:
        async with aclosing(events):
            for item in first:
                yield item
            async for item in events:
                yield item

    return rest()
