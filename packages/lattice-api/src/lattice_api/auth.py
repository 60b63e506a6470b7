"""Who is calling: identity and role (what they may do is lattice_api.permissions).

Identity comes from a bearer token, in the specification's order of priority:

* **JWKS** (``api.oidc_issuer`` set): an RS256/ES256 token of the identity provider,
  checked against its published keys (lattice_api.oidc) for iss, aud (=
  ``api.oidc_client_id``), exp, nbf and iat with a small leeway;
* **HMAC** (``api.oidc_hmac_secret`` set): an HS256 token signed with that secret (dev,
  tests, break-glass); with both set an HS256 token is checked against the secret only,
  so an HS256 token "signed" with the IdP's public key is refused;
* **none**: the ``x-lattice-user`` header is trusted (dev clusters only; the server logs
  a prominent warning at start in that mode).

Any other algorithm (``none`` included) is refused. The node agents' shared token is
recognised in every mode.

A verified client certificate (mTLS, lattice_common.pki) takes priority over any
token: it names a node agent, a bootstrap identity (which may only ask for the agent's
certificate) or an internal service (scheduler, checkpoint broker, accounting, API
member), for this site only, and is refused once expired even on a connection opened
before. Roles follow the specification's table (scopes first, then
the lattice_role/pact_role claims).

:meth:`Authenticator.authenticate` never does I/O (cached keys only);
:meth:`Authenticator.authenticate_async`, what the REST middleware and the gRPC
interceptor await, refreshes the key set once (rate-limited) when a token names a key
the cache does not hold, so a key rotation at the IdP needs no restart.
"""

from __future__ import annotations

import enum
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from lattice_common import pki
from lattice_common.errors import Unauthenticated

from lattice_api.oidc import KeyRefreshNeeded, OidcProvider

log = logging.getLogger("lattice.api.auth")


class Role(enum.StrEnum):
    SYSTEM_ADMIN = "system-admin"
    TENANT_ADMIN = "tenant-admin"
    OPERATOR = "operator"
    CLAIMING_USER = "claiming-user"
    READ_ONLY = "readonly"
    USER = "user"
    AGENT = "agent"
    # from certificates only (mTLS): a node's first contact, and the internal services
    BOOTSTRAP = "bootstrap"
    SERVICE = "service"
    # an external budget authority's service token (Waldur, spec: Quota Feedback Loop):
    # scope ``quota:update``; it may set a tenant's quotas and nothing else
    QUOTA_SERVICE = "quota-service"


#: roles no token gives: only a client certificate does
CERT_ROLES = frozenset({Role.BOOTSTRAP, Role.SERVICE})
_CERT_KIND_ROLES = {
    pki.Kind.AGENT: Role.AGENT,
    pki.Kind.BOOTSTRAP: Role.BOOTSTRAP,
    pki.Kind.API: Role.SERVICE,
    pki.Kind.SCHEDULER: Role.SERVICE,
    pki.Kind.CHECKPOINT: Role.SERVICE,
    pki.Kind.ACCOUNTING: Role.SERVICE,
}


_SCOPES = {
    "admin": Role.SYSTEM_ADMIN,
    "system:admin": Role.SYSTEM_ADMIN,
    "tenant:admin": Role.TENANT_ADMIN,
    "operator": Role.OPERATOR,
    "sensitive:claim": Role.CLAIMING_USER,
    "readonly": Role.READ_ONLY,
    "quota:update": Role.QUOTA_SERVICE,
}
_CLAIMS = {
    "pact-platform-admin": Role.SYSTEM_ADMIN,
    "system-admin": Role.SYSTEM_ADMIN,
    "tenant-admin": Role.TENANT_ADMIN,
    "operator": Role.OPERATOR,
}


class Identity:
    """The caller: user (the token's subject), role, tenant; ``expires_at`` (epoch
    seconds) and ``method`` (oidc, hmac, agent, mtls, spiffe, none) say how it was
    established; ``cert``: what a client certificate named (mTLS)."""

    __slots__ = ("cert", "expires_at", "method", "role", "tenant", "user")

    def __init__(
        self,
        user: str,
        role: Role,
        tenant: str = "",
        *,
        expires_at: float | None = None,
        method: str = "",
        cert: pki.CertIdentity | None = None,
    ) -> None:
        self.user = user
        self.role = role
        self.tenant = tenant
        self.expires_at = expires_at
        self.method = method
        self.cert = cert

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


_LOGIN_HINT = "Run `lattice login` again."


TOKEN_CACHE_SECONDS = 60.0
TOKEN_CACHE_SIZE = 10_000


class Authenticator:
    def __init__(
        self,
        *,
        hmac_secret: str | None = None,
        agent_token: str | None = None,
        oidc: OidcProvider | None = None,
        site: str = "local",
    ) -> None:
        self._secret = hmac_secret or None
        self.site = site  # client certificates must name this site
        # validated bearer tokens -> (identity, until): a signature check costs more than
        # the rest of a small request; entries live TOKEN_CACHE_SECONDS at most (a key
        # withdrawn from the IdP stops being accepted within that) and never past exp
        self._verified: OrderedDict[str, tuple[Identity, float]] = OrderedDict()
        self._agent_token = agent_token or None
        self._previous_agent_token: str | None = None
        self.oidc = oidc
        # (source address, headers, reason) of each request that fails authentication,
        # called by the REST middleware and the gRPC interceptor: the audit log's
        # rate-limited record (lattice_api.audit.AuditRecorder.auth_failed)
        self.on_failure: Callable[[str, Mapping[str, str], str], None] | None = None

    def set_hmac_secret(self, secret: str | None) -> None:
        """A rotated HS256 secret (lattice_api.rotation): tokens signed with the old one
        are refused from now on."""
        self._secret = secret or None
        self._verified.clear()

    def set_agent_token(self, token: str | None) -> None:
        """A rotated agent token. The previous one stays accepted until the next
        rotation: agents and schedulers read the token at their start, so they can be
        restarted one by one."""
        if token and token != self._agent_token:
            self._previous_agent_token = self._agent_token
            self._agent_token = token

    @property
    def dev_mode(self) -> bool:
        return self._secret is None and self.oidc is None

    @property
    def mode(self) -> str:
        """What validates tokens: ``oidc`` (JWKS), ``hmac`` or ``none``."""
        return "oidc" if self.oidc is not None else "hmac" if self._secret else "none"

    async def start(self) -> None:
        """Pre-fetch the identity provider's discovery document and keys."""
        if self.oidc is not None:
            await self.oidc.start()

    def from_certificate(self, peercert: Mapping[str, object], now: float) -> Identity:
        """The caller a verified client certificate names (the TLS layer checked the
        chain; here the name, the site and the expiry)."""
        cert = pki.peer_identity(peercert)
        if cert is None:
            raise Unauthenticated(
                "the client certificate names no Lattice component",
                hint="Use a certificate issued by `lattice admin ca issue` or the node's "
                "agent certificate.",
            )
        if cert.site != self.site:
            raise Unauthenticated(
                f"the client certificate is for site {cert.site!r}, this is {self.site!r}",
                hint="Check tls.site on both sides.",
            )
        if now >= cert.not_after:
            raise Unauthenticated(
                f"the client certificate of {cert.kind.value} {cert.name} has expired",
                hint="Agents renew at two thirds of the lifetime; restart the agent with a "
                "bootstrap certificate (`lattice admin ca issue --kind bootstrap`).",
            )
        method = "spiffe" if cert.source == "spiffe" else "mtls"
        return Identity(
            f"{cert.kind.value}:{cert.name}",
            _CERT_KIND_ROLES[cert.kind],
            expires_at=cert.not_after,
            method=method,
            cert=cert,
        )

    async def authenticate_async(
        self, headers: Mapping[str, str], peercert: Mapping[str, object] | None = None
    ) -> Identity:
        """:meth:`authenticate`, refreshing the IdP's key set (at most once per its
        ``min_refresh_interval``) when the token names a key not in the cache. A
        verified client certificate (``peercert``) comes first."""
        if peercert:
            return self.from_certificate(peercert, time.time())
        try:
            return self.authenticate(headers)
        except KeyRefreshNeeded as first:
            if self.oidc is None:  # pragma: no cover - raised by the provider only
                raise
            err = first
        refreshed = await self.oidc.refresh()
        if refreshed:  # a key may have been withdrawn: what it signed is checked again
            self._verified.clear()
        if not self.oidc.metadata:
            raise self.oidc.unavailable() from None
        if refreshed:
            try:
                return self.authenticate(headers)
            except KeyRefreshNeeded as again:
                err = again
        raise Unauthenticated(err.message, hint=err.hint) from None

    def authenticate(self, headers: Mapping[str, str]) -> Identity:
        auth = headers.get("authorization") or headers.get("Authorization") or ""
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if token and self._is_agent_token(token):
            return Identity("lattice-agent", Role.AGENT, method="agent")
        if self.dev_mode:
            user = headers.get("x-lattice-user") or headers.get("X-Lattice-User") or "anonymous"
            # No authentication configured: every caller is trusted (dev clusters only).
            return Identity(
                user, Role.SYSTEM_ADMIN, headers.get("x-lattice-tenant", ""), method="none"
            )
        if not token:
            raise Unauthenticated(
                "missing bearer token", hint="Not logged in. Run `lattice login` first."
            )
        now = time.time()
        hit = self._verified.get(token)
        if hit is not None and now < hit[1]:
            self._verified.move_to_end(token)
            return hit[0]
        who = self._verify(token)
        until = now + TOKEN_CACHE_SECONDS
        if who.expires_at is not None:
            until = min(until, who.expires_at)
        if until > now:
            self._verified[token] = (who, until)
            while len(self._verified) > TOKEN_CACHE_SIZE:
                self._verified.popitem(last=False)
        return who

    def _verify(self, token: str) -> Identity:
        import jwt  # imported lazily: not needed in dev mode

        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"invalid token: {e}", hint=_LOGIN_HINT) from None
        alg = header.get("alg")
        if self.oidc is not None and not (alg == "HS256" and self._secret):
            claims = self.oidc.verify(token, header)
            role = role_from_claims(claims)
            method = "oidc"
        else:
            claims = self._hmac_claims(token)
            agent = claims.get("lattice_role") == "agent"
            role = Role.AGENT if agent else role_from_claims(claims)
            method = "hmac"
        exp = claims.get("exp")
        return Identity(
            str(claims["sub"]),
            role,
            str(claims.get("tenant", "")),
            expires_at=float(exp) if isinstance(exp, int | float) else None,
            method=method,
        )

    def _is_agent_token(self, token: str) -> bool:
        return any(
            known and hmac.compare_digest(token, known)
            for known in (self._agent_token, self._previous_agent_token)
        )

    def _hmac_claims(self, token: str) -> dict:
        import jwt

        if self._secret is None:  # pragma: no cover - dev mode returned earlier
            raise Unauthenticated("invalid token: HS256 is not accepted", hint=_LOGIN_HINT)
        try:
            return jwt.decode(
                token, self._secret, algorithms=["HS256"], options={"require": ["sub"]}
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("token expired", hint=_LOGIN_HINT) from None
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"invalid token: {e}", hint=_LOGIN_HINT) from None
