"""What the gRPC adapters share: the caller's identity (set by the interceptor), the
error mapping, and proto-message-to-dict helpers."""

from __future__ import annotations

import contextvars
from typing import Any

from lattice_common.errors import LatticeError, ValidationError
from lattice_common.rpc import grpc_error
from lattice_common.wire import message_to_dict

from lattice_api.auth import Identity

_identity: contextvars.ContextVar[Identity | LatticeError] = contextvars.ContextVar("identity")


def set_identity(identity: Identity | LatticeError) -> None:
    _identity.set(identity)


def who() -> Identity:
    """The caller of the current RPC (raises what authentication raised)."""
    ident = _identity.get()
    if isinstance(ident, LatticeError):
        raise ident
    return ident


def to_body(message: Any) -> dict[str, Any]:
    """A proto message as the plain dict the operations take (snake_case keys)."""
    return message_to_dict(message)


def update_fields(message: Any, kind: str) -> dict[str, Any]:
    """Fields to change, from an Update*Request (an explicit field mask if present)."""
    record = getattr(message, kind, None)
    if record is None:
        raise ValidationError(f"Update needs a {kind}")
    data = to_body(record)
    mask = list(getattr(message, "update_mask", []) or getattr(message, "fields", []) or [])
    if mask:
        return {k: data.get(k) for k in mask}
    return {k: v for k, v in data.items() if k not in ("name", "created_at", "revision")}


__all__ = ["grpc_error", "set_identity", "to_body", "update_fields", "who"]
