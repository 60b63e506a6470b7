"""Who the server trusts and who the caller is: the login discovery document
(``GET /api/v1/auth/discovery``, public) and whoami (``GET /api/v1/auth/whoami``).

Discovery gives a client everything it needs from the server URL alone: the issuer and
client id, and the identity provider's authorization, token, device authorization and
revocation endpoints (from the IdP's own discovery document, cached by
lattice_api.oidc). Without ``api.oidc_issuer`` the endpoints are empty and ``mode`` says
whether the server takes HS256 tokens (``hmac``) or trusts the dev header (``none``).

There is no gRPC RPC for either: the proto contract has none (REST only).
"""

from __future__ import annotations

from typing import Any

from lattice_api.auth import Identity
from lattice_api.oidc import OidcProvider

#: IdP discovery fields a login client needs, copied into the server's document
IDP_ENDPOINTS = (
    "authorization_endpoint",
    "token_endpoint",
    "device_authorization_endpoint",
    "revocation_endpoint",
    "jwks_uri",
)


class AuthOps:
    def __init__(
        self,
        *,
        oidc_issuer: str = "",
        oidc_client_id: str = "lattice",
        oidc: OidcProvider | None = None,
        mode: str = "",
    ) -> None:
        self.oidc_issuer = oidc_issuer.rstrip("/")
        self.oidc_client_id = oidc_client_id
        self.oidc = oidc
        self.mode = mode or ("oidc" if oidc_issuer else "")

    async def discovery(self) -> dict[str, Any]:
        """Where clients log in: ``{idp_url, issuer, client_id, mode, <endpoints>}``."""
        doc: dict[str, Any] = {
            "idp_url": self.oidc_issuer,
            "issuer": self.oidc_issuer,
            "client_id": self.oidc_client_id,
            "mode": self.mode,
        }
        meta = await self.oidc.login_metadata() if self.oidc is not None else {}
        for key in IDP_ENDPOINTS:
            doc[key] = str(meta.get(key) or "")
        return doc

    def whoami(self, who: Identity) -> dict[str, Any]:
        """The caller as the server sees it: user, role, tenant, how it authenticated
        and when its token expires (epoch seconds; None without one)."""
        return {
            "user": who.user,
            "role": who.role.value,
            "tenant": who.tenant,
            "method": who.method,
            "expires_at": who.expires_at,
        }


__all__ = ["IDP_ENDPOINTS", "AuthOps"]
