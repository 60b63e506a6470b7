"""Who is calling: identity and role (what they may do is lattice_api.permissions).

Identity comes from a bearer token (HS256 with the configured dev secret, validated
with PyJWT) or, when no secret is configured, from the ``x-lattice-user`` header; the
server logs a prominent warning at start in that mode. Roles follow the
specification's table (scopes first, then the lattice_role/pact_role claims).
"""

from __future__ import annotations

import enum
import hmac
import logging
from collections.abc import Mapping

from lattice_common.errors import Unauthenticated

log = logging.getLogger("lattice.api.auth")


class Role(enum.StrEnum):
    SYSTEM_ADMIN = "system-admin"
    TENANT_ADMIN = "tenant-admin"
    OPERATOR = "operator"
    CLAIMING_USER = "claiming-user"
    READ_ONLY = "readonly"
    USER = "user"
    AGENT = "agent"


_SCOPES = {
    "admin": Role.SYSTEM_ADMIN,
    "system:admin": Role.SYSTEM_ADMIN,
    "tenant:admin": Role.TENANT_ADMIN,
    "operator": Role.OPERATOR,
    "sensitive:claim": Role.CLAIMING_USER,
    "readonly": Role.READ_ONLY,
}
_CLAIMS = {
    "pact-platform-admin": Role.SYSTEM_ADMIN,
    "system-admin": Role.SYSTEM_ADMIN,
    "tenant-admin": Role.TENANT_ADMIN,
    "operator": Role.OPERATOR,
}


class Identity:
    __slots__ = ("role", "tenant", "user")

    def __init__(self, user: str, role: Role, tenant: str = "") -> None:
        self.user = user
        self.role = role
        self.tenant = tenant

    def __repr__(self) -> str:
        return f"Identity({self.user!r}, {self.role.value})"


def role_from_claims(claims: Mapping[str, object]) -> Role:
    raw = claims.get("scope") or claims.get("scp") or ""
    scopes = [str(x) for x in raw] if isinstance(raw, list) else str(raw).split()
    for s in scopes:
        if s in _SCOPES:
            return _SCOPES[s]
    for key in ("lattice_role", "pact_role"):
        v = str(claims.get(key) or "")
        if v in _CLAIMS:
            return _CLAIMS[v]
    return Role.USER


class Authenticator:
    def __init__(self, *, hmac_secret: str | None = None, agent_token: str | None = None) -> None:
        self._secret = hmac_secret or None
        self._agent_token = agent_token or None

    @property
    def dev_mode(self) -> bool:
        return self._secret is None

    def authenticate(self, headers: Mapping[str, str]) -> Identity:
        auth = headers.get("authorization") or headers.get("Authorization") or ""
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if token and self._agent_token and hmac.compare_digest(token, self._agent_token):
            return Identity("lattice-agent", Role.AGENT)
        if self._secret is None:
            user = headers.get("x-lattice-user") or headers.get("X-Lattice-User") or "anonymous"
            # No authentication configured: every caller is trusted (dev clusters only).
            return Identity(user, Role.SYSTEM_ADMIN, headers.get("x-lattice-tenant", ""))
        if not token:
            raise Unauthenticated(
                "missing bearer token", hint="Not logged in. Run `lattice login` first."
            )
        import jwt  # imported lazily: not needed in dev mode

        try:
            claims = jwt.decode(
                token, self._secret, algorithms=["HS256"], options={"require": ["sub"]}
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("token expired", hint="Run `lattice login` again.") from None
        except jwt.PyJWTError as e:
            raise Unauthenticated(
                f"invalid token: {e}", hint="Run `lattice login` again."
            ) from None
        role = Role.AGENT if claims.get("lattice_role") == "agent" else role_from_claims(claims)
        return Identity(str(claims["sub"]), role, str(claims.get("tenant", "")))
