"""Domain errors raised by service cores, and the one table that maps them to gRPC codes.

Cores import these and never grpc; the gRPC edge (``omniflow.rpc``) translates them.
Messages say what was wrong and what is accepted.
"""

from __future__ import annotations


class OmniflowError(Exception):
    """Base of every domain error; ``code_name`` is the gRPC status code it maps to."""

    code_name = "INTERNAL"


class InvalidArgument(OmniflowError):
    """Bad input from the caller (a value out of range, a malformed field)."""

    code_name = "INVALID_ARGUMENT"


class NotFound(OmniflowError):
    """An unknown name or id (workflow, run, namespace, tensor reference)."""

    code_name = "NOT_FOUND"


class AlreadyExists(OmniflowError):
    """A create of something that exists and may not be replaced."""

    code_name = "ALREADY_EXISTS"


class ResourceExhausted(OmniflowError):
    """No capacity: a full pool, too many concurrent runs, a budget reached."""

    code_name = "RESOURCE_EXHAUSTED"


class FailedPrecondition(OmniflowError):
    """The system is not in a state where the call can run (stale epoch, not loaded)."""

    code_name = "FAILED_PRECONDITION"


class Unavailable(OmniflowError):
    """A dependency cannot be reached right now; the caller may retry elsewhere."""

    code_name = "UNAVAILABLE"


class DeadlineExceeded(OmniflowError):
    """The call's deadline passed before it finished."""

    code_name = "DEADLINE_EXCEEDED"


class Cancelled(OmniflowError):
    """The work was cancelled by the caller or by a shutdown."""

    code_name = "CANCELLED"


class DataLoss(OmniflowError):
    """Data failed verification (a checksum mismatch) and was dropped."""

    code_name = "DATA_LOSS"


class Unimplemented(OmniflowError):
    """The operation is not available in this build or on this worker."""

    code_name = "UNIMPLEMENTED"


class Unauthenticated(OmniflowError):
    """The caller could not be identified (no certificate identity, an unknown token)."""

    code_name = "UNAUTHENTICATED"


class PermissionDenied(OmniflowError):
    """The caller is known but may not do this (docs/security.md has the policy)."""

    code_name = "PERMISSION_DENIED"
