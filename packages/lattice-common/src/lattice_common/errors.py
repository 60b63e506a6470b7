"""Typed errors that carry a message, the numbers behind it and a hint.

Raised anywhere (state machine, validation, API); mapped once to gRPC and HTTP status
codes here, and rendered for people (by :func:`lattice_common.error_text.render_error`,
shared with the CLI, the SDK and RM-Replay) as::

    Error: <message>
      <Key>: <value>
    Hint: <hint>
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from lattice_common.error_text import render_error


class LatticeError(Exception):
    """Base class. ``code`` is the stable machine name carried over the wire."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    grpc_status: ClassVar[int] = 13  # INTERNAL

    def __init__(self, message: str, *, details: dict[str, Any] | None = None, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})
        self.hint = hint

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "details": self.details,
            "hint": self.hint,
        }

    def render(self) -> str:
        """The form people read (see :mod:`lattice_common.error_text`)."""
        return render_error(self.message, self.details, self.hint)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> LatticeError:
        cls = ERROR_CLASSES.get(d.get("code", ""), LatticeError)
        return cls(
            d.get("message", "unknown error"),
            details=d.get("details") or {},
            hint=d.get("hint", ""),
        )


class ValidationError(LatticeError):
    code = "invalid_argument"
    http_status = 400
    grpc_status = 3  # INVALID_ARGUMENT


class NotFound(LatticeError):
    code = "not_found"
    http_status = 404
    grpc_status = 5  # NOT_FOUND


class AlreadyExists(LatticeError):
    code = "already_exists"
    http_status = 409
    grpc_status = 6  # ALREADY_EXISTS


class InvalidTransition(LatticeError):
    code = "invalid_transition"
    http_status = 409
    grpc_status = 9  # FAILED_PRECONDITION


class OwnershipConflict(LatticeError):
    code = "ownership_conflict"
    http_status = 409
    grpc_status = 10  # ABORTED


class StaleRevision(LatticeError):
    code = "stale_revision"
    http_status = 409
    grpc_status = 10  # ABORTED


class QuotaExceeded(LatticeError):
    code = "quota_exceeded"
    http_status = 429
    grpc_status = 8  # RESOURCE_EXHAUSTED


class RateLimited(LatticeError):
    """A per-user or per-node limit of the API (spec: Rate Limiting). ``retry_after``
    (seconds, also in ``details["retry_after_seconds"]``) becomes the ``Retry-After``
    header (REST) and the ``retry-after`` trailing metadata (gRPC)."""

    code = "rate_limited"
    http_status = 429
    grpc_status = 8  # RESOURCE_EXHAUSTED

    @property
    def retry_after(self) -> int:
        return int(self.details.get("retry_after_seconds") or 1)


class Unsatisfiable(LatticeError):
    """A request that can never run as asked on this cluster (more nodes than exist,
    constraints no node meets); refused at submit, nothing stored."""

    code = "unsatisfiable"
    http_status = 422
    grpc_status = 9  # FAILED_PRECONDITION


class FailedPrecondition(LatticeError):
    """The cluster is not set up for the request yet (no internal CA, ...)."""

    code = "failed_precondition"
    http_status = 412
    grpc_status = 9  # FAILED_PRECONDITION


class Unauthenticated(LatticeError):
    code = "unauthenticated"
    http_status = 401
    grpc_status = 16  # UNAUTHENTICATED


class PermissionDenied(LatticeError):
    code = "permission_denied"
    http_status = 403
    grpc_status = 7  # PERMISSION_DENIED


class Unavailable(LatticeError):
    code = "unavailable"
    http_status = 503
    grpc_status = 14  # UNAVAILABLE


class NotLeader(Unavailable):
    code = "not_leader"


class Unimplemented(LatticeError):
    code = "unimplemented"
    http_status = 501
    grpc_status = 12  # UNIMPLEMENTED


ERROR_CLASSES: dict[str, type[LatticeError]] = {
    c.code: c
    for c in (
        LatticeError,
        ValidationError,
        NotFound,
        AlreadyExists,
        InvalidTransition,
        OwnershipConflict,
        StaleRevision,
        QuotaExceeded,
        RateLimited,
        Unsatisfiable,
        FailedPrecondition,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        NotLeader,
        Unimplemented,
    )
}


def encode_error(err: LatticeError) -> bytes:
    """Compact JSON form used in gRPC status details and Raft results."""
    return msgspec.json.encode(err.to_dict())


def decode_error(raw: bytes | str) -> LatticeError:
    return LatticeError.from_dict(msgspec.json.decode(raw))
