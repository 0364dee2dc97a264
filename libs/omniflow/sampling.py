"""The one sampling contract: what a generation may do, checked once, the same at every hop.

The gateway builds it from a request, the coordinator from a workflow node's params, the
worker from the proto; every engine backend reads it. Nothing here needs torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from omniflow.api.common.v1 import common_pb2
from omniflow.errors import InvalidArgument

#: What ``StructuredOutput.kind`` may be, and what its ``spec`` holds.
STRUCTURED_KINDS = {
    "json": "a JSON-schema text",
    "json_object": "empty (any JSON object)",
    "regex": "the regex",
    "choice": "a JSON list of strings",
    "grammar": "an EBNF grammar text",
}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text, enforced while decoding (by the worker's grammar
    engine). ``kind`` is a key of ``STRUCTURED_KINDS``; ``spec`` is what that key names."""

    kind: str
    spec: str = ""

    def validate(self, field: str = "structured") -> None:
        """Raise ``InvalidArgument`` naming ``field`` for an unknown kind or a spec of the
        wrong shape. Whether a schema, regex or grammar compiles is the grammar engine's
        check."""
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidArgument(
                f"{field}: kind {self.kind!r} is not one of {', '.join(STRUCTURED_KINDS)}"
            )
        if self.kind == "json_object":
            if self.spec:
                raise InvalidArgument(f"{field}: kind 'json_object' takes no spec")
            return
        if not self.spec:
            raise InvalidArgument(
                f"{field}: kind {self.kind!r} needs a spec ({STRUCTURED_KINDS[self.kind]})"
            )
        if self.kind in ("json", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError:
                raise InvalidArgument(
                    f"{field}: the spec of kind {self.kind!r} is not valid JSON "
                    f"({STRUCTURED_KINDS[self.kind]})"
                ) from None
            if self.kind == "json" and not isinstance(value, dict | bool):
                raise InvalidArgument(f"{field}: a JSON schema is an object or a boolean")
            if self.kind == "choice" and (
                not isinstance(value, list)
                or not value
                or not all(isinstance(v, str) for v in value)
            ):
                raise InvalidArgument(f"{field}: choice takes a non-empty list of strings")

    def to_proto(self) -> common_pb2.StructuredOutput:
        return common_pb2.StructuredOutput(kind=self.kind, spec=self.spec)

    @staticmethod
    def from_proto(m: common_pb2.StructuredOutput) -> StructuredOutput:
        return StructuredOutput(kind=m.kind, spec=m.spec)
