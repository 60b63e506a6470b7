"""Typed errors raised by :class:`lattice_sdk.LatticeClient`.

The server answers every failure with ``{"error": {"code", "message", "details", "hint"}}``;
this module turns that body plus the HTTP status into one exception class, so callers can
``except LatticeNotFoundError`` instead of comparing status codes. Failures to reach the
server at all (connection refused, DNS, timeouts) become :class:`LatticeUnavailableError`
with a message that names the endpoint.

Kept free of third-party imports: the CLI imports it on every run. The one outside import,
:mod:`lattice_common.error_text`, is the standard-library-only module that renders errors
the same way in the CLI, the SDK, the core and RM-Replay.
"""

from __future__ import annotations

from typing import Any

from lattice_common.error_text import render_error

UNREACHABLE_HINT = (
    "Start a local cluster with `lattice dev up` or set LATTICE_ENDPOINT to the API address."
)


class LatticeError(Exception):
    """Any error reported by the Lattice API or raised while talking to it.

    ``status_code`` is the HTTP status (``None`` when no response arrived), ``code`` the
    server's stable machine name (``not_found``, ``quota_exceeded`` ...), ``details`` the
    numbers behind the message and ``hint`` what to do about it.
    """

    def __init__(
        self,
        message: str,
        status_code: int | None = None,
        code: str = "",
        details: dict[str, Any] | None = None,
        hint: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.details: dict[str, Any] = dict(details or {})
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, status_code={self.status_code!r}, "
            f"code={self.code!r})"
        )

    def render(self) -> str:
        """The user-facing form::

        Error: <message>
          <Key>: <value>
        Hint: <hint>
        """
        return render_error(self.message, self.details, self.hint)


class LatticeValidationError(LatticeError):
    """The request was malformed or failed validation (HTTP 400)."""


class LatticeAuthError(LatticeError):
    """Missing, invalid or insufficient credentials (HTTP 401 or 403)."""


class LatticeNotFoundError(LatticeError):
    """The allocation, node, tenant or vCluster does not exist (HTTP 404)."""


class LatticeConflictError(LatticeError):
    """The request conflicts with the current state, e.g. an invalid transition (HTTP 409)."""


class LatticeUnavailableError(LatticeError):
    """The API cannot be reached or has no leader right now (HTTP 503, connection refused)."""


_BY_STATUS: dict[int, type[LatticeError]] = {
    400: LatticeValidationError,
    401: LatticeAuthError,
    403: LatticeAuthError,
    404: LatticeNotFoundError,
    409: LatticeConflictError,
    422: LatticeValidationError,
    502: LatticeUnavailableError,
    503: LatticeUnavailableError,
    504: LatticeUnavailableError,
}

_DEFAULT_HINTS: dict[int, str] = {
    401: "Set a token with LATTICE_TOKEN or `token:` in ~/.config/lattice/config.yaml.",
    403: "Your identity lacks the role for this operation; ask your tenant or system admin.",
}


_BY_CODE: dict[str, type[LatticeError]] = {
    "invalid_argument": LatticeValidationError,
    "unsatisfiable": LatticeValidationError,
    "unauthenticated": LatticeAuthError,
    "permission_denied": LatticeAuthError,
    "not_found": LatticeNotFoundError,
    "already_exists": LatticeConflictError,
    "invalid_transition": LatticeConflictError,
    "ownership_conflict": LatticeConflictError,
    "stale_revision": LatticeConflictError,
    "unavailable": LatticeUnavailableError,
    "not_leader": LatticeUnavailableError,
}


def error_class_for_code(code: str) -> type[LatticeError]:
    """For errors that arrive without an HTTP status (inside a stream)."""
    return _BY_CODE.get(code, LatticeError)


def error_class_for_status(status: int) -> type[LatticeError]:
    return _BY_STATUS.get(status, LatticeError)


def error_from_response(
    status: int, reason: str, body: bytes | str | None, *, method: str = "", url: str = ""
) -> LatticeError:
    """Build the typed error for a non-2xx response.

    Understands the server's ``{"error": {...}}`` envelope; falls back to the status line
    and a snippet of the body for anything else (a proxy's HTML page, an empty body).
    """
    import json

    cls = error_class_for_status(status)
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    payload: Any = None
    if text.strip():
        try:
            payload = json.loads(text)
        except ValueError:
            payload = None
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, str):
        err = {"message": err}
    if isinstance(err, dict):
        message = str(err.get("message") or f"HTTP {status} {reason}".strip())
        details = err.get("details")
        return cls(
            message,
            status_code=status,
            code=str(err.get("code") or ""),
            details=details if isinstance(details, dict) else {},
            hint=str(err.get("hint") or _DEFAULT_HINTS.get(status, "")),
        )
    where = f" ({method} {url})" if method or url else ""
    snippet = " ".join(text.split())[:200]
    message = f"HTTP {status} {reason}".strip() + where
    if snippet:
        message += f": {snippet}"
    return cls(message, status_code=status, hint=_DEFAULT_HINTS.get(status, ""))


def unreachable(endpoint: str, cause: str) -> LatticeUnavailableError:
    """The error for a request that got no HTTP response at all."""
    return LatticeUnavailableError(
        f"cannot reach the Lattice API at {endpoint}: {cause}",
        status_code=None,
        code="unavailable",
        details={"endpoint": endpoint},
        hint=UNREACHABLE_HINT,
    )
