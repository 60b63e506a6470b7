"""The server's view of its OIDC provider: the discovery document and the signing keys.

``api.oidc_issuer`` names the identity provider. At start the server fetches
``<issuer>/.well-known/openid-configuration`` and the key set at its ``jwks_uri``, both
with HTTP redirects disabled (a redirect could point the server at an attacker's keys)
and the discovery document's ``issuer`` checked against the configured one. Tokens are
then checked against the cached keys without any I/O (:meth:`OidcProvider.verify`); a
token signed with a key id the cache does not hold makes the caller refresh the key set
(:meth:`OidcProvider.refresh`), at most once per ``min_refresh_interval`` seconds however
many such tokens arrive, so a rotation at the IdP is picked up without a restart while a
flood of forged key ids cannot turn the server into a JWKS fetching loop.

Only RS256 and ES256 are accepted from the key set; each key is used only with the
algorithm its key type allows (an RSA key never verifies an HMAC signature).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import jwt
from lattice_common.errors import Unauthenticated, Unavailable

log = logging.getLogger("lattice.api.oidc")

#: the signature algorithms accepted from the IdP's key set -> the key type each needs
ALGORITHMS: dict[str, str] = {"RS256": "RSA", "ES256": "EC"}
#: seconds of clock skew tolerated on exp, nbf and iat
LEEWAY_SECONDS = 30.0
#: the fewest seconds between two key set fetches caused by unknown key ids
MIN_REFRESH_INTERVAL = 30.0
FETCH_TIMEOUT = 10.0
_LOGIN_HINT = "Run `lattice login` again."


class KeyRefreshNeeded(Unauthenticated):
    """The token names a signing key the cache does not hold (or no key set has been
    fetched yet): refresh the key set and try once more (internal to lattice_api)."""


class OidcFetchError(Exception):
    """Discovery or the key set could not be fetched or read."""


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OidcProvider:
    """Discovery document and JWKS cache of one issuer, for one audience (client id)."""

    def __init__(
        self,
        issuer: str,
        client_id: str,
        *,
        leeway: float = LEEWAY_SECONDS,
        min_refresh_interval: float = MIN_REFRESH_INTERVAL,
        timeout: float = FETCH_TIMEOUT,
    ) -> None:
        self.issuer = issuer.rstrip("/")
        self.client_id = client_id
        self.leeway = leeway
        self.min_refresh_interval = min_refresh_interval
        self.timeout = timeout
        self.metadata: dict[str, Any] = {}
        self._keys: dict[str, jwt.PyJWK] = {}
        self._last_fetch = float("-inf")  # monotonic time of the last key set fetch
        self._lock = asyncio.Lock()
        self.fetches = 0  # key set fetches made (for tests and the log)
        if not self.issuer.startswith("https://") and not is_loopback_url(self.issuer):
            log.warning(
                "api.oidc_issuer %s is not an https URL: discovery and keys can be "
                "tampered with in transit (MITM). Use https outside development.",
                self.issuer,
            )

    # --- fetching (async, aiohttp, no redirects) ------------------------------------------

    @property
    def discovery_url(self) -> str:
        return self.issuer + "/.well-known/openid-configuration"

    async def _get_json(self, url: str) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(
                    url, allow_redirects=False, headers={"Accept": "application/json"}
                ) as resp,
            ):
                if 300 <= resp.status < 400:
                    raise OidcFetchError(
                        f"{url} answered a redirect ({resp.status}); redirects are not "
                        "followed for discovery and keys"
                    )
                if resp.status != 200:
                    raise OidcFetchError(f"{url} answered HTTP {resp.status}")
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise OidcFetchError(f"cannot fetch {url}: {e or type(e).__name__}") from None
        try:
            return json.loads(body)
        except ValueError:
            raise OidcFetchError(f"{url} did not answer JSON") from None

    async def _fetch_metadata(self) -> dict[str, Any]:
        doc = await self._get_json(self.discovery_url)
        if not isinstance(doc, dict):
            raise OidcFetchError(f"{self.discovery_url} is not a JSON object")
        if str(doc.get("issuer", "")).rstrip("/") != self.issuer:
            raise OidcFetchError(
                f"the discovery document names issuer {doc.get('issuer')!r}, "
                f"not the configured {self.issuer!r}"
            )
        if not doc.get("jwks_uri"):
            raise OidcFetchError(f"{self.discovery_url} has no jwks_uri")
        return doc

    async def _fetch_keys(self, jwks_uri: str) -> dict[str, jwt.PyJWK]:
        doc = await self._get_json(jwks_uri)
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
            raise OidcFetchError(f"{jwks_uri} is not a JWK set")
        keys: dict[str, jwt.PyJWK] = {}
        for raw in doc["keys"]:
            if not isinstance(raw, dict) or raw.get("use", "sig") != "sig":
                continue
            if raw.get("kty") not in ALGORITHMS.values():
                continue
            try:
                key = jwt.PyJWK(raw)
            except jwt.PyJWTError as e:
                log.warning("skipping a key of %s: %s", jwks_uri, e)
                continue
            keys[str(raw.get("kid", ""))] = key
        return keys

    async def refresh(self, *, force: bool = False) -> bool:
        """Fetch discovery (first time) and the key set, unless the last fetch was less
        than ``min_refresh_interval`` seconds ago (and not ``force``). Concurrent callers
        share one fetch. True when a fetch was made and succeeded."""
        async with self._lock:
            now = time.monotonic()
            if not force and now - self._last_fetch < self.min_refresh_interval:
                return False
            self._last_fetch = now
            self.fetches += 1
            try:
                if not self.metadata:
                    self.metadata = await self._fetch_metadata()
                keys = await self._fetch_keys(str(self.metadata["jwks_uri"]))
            except OidcFetchError as e:
                log.error("OIDC provider %s: %s", self.issuer, e)
                return False
            added = set(keys) - set(self._keys)
            removed = set(self._keys) - set(keys)
            self._keys = keys
            log.info(
                "OIDC provider %s: %d signing keys (added %s, removed %s)",
                self.issuer,
                len(keys),
                sorted(added) or "none",
                sorted(removed) or "none",
            )
            return True

    async def start(self) -> None:
        """Pre-fetch discovery and keys; an unreachable IdP is logged, not fatal (the
        first token then triggers another attempt)."""
        await self.refresh(force=True)

    async def login_metadata(self) -> dict[str, Any]:
        """The discovery document (fetched now if the start-up fetch failed)."""
        if not self.metadata:
            await self.refresh()
        return self.metadata

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    # --- validation (sync, cached keys only) ----------------------------------------------

    def verify(self, token: str, header: Mapping[str, Any]) -> dict[str, Any]:
        """The claims of ``token`` (whose unverified ``header`` the caller read) if it is
        signed by a key of the cached set with RS256/ES256 and its iss, aud, exp, nbf and
        iat hold. Raises KeyRefreshNeeded for a key id not in the cache, Unauthenticated
        for everything else."""
        alg = str(header.get("alg", ""))
        kty = ALGORITHMS.get(alg)
        if kty is None:
            raise Unauthenticated(
                f"invalid token: algorithm {alg or 'none'!r} is not accepted "
                f"(accepted: {', '.join(ALGORITHMS)})",
                hint=_LOGIN_HINT,
            )
        if not self._keys and not self.metadata:
            raise KeyRefreshNeeded(
                "the identity provider's signing keys are not available yet",
                hint="The server cannot reach its identity provider; try again shortly.",
            )
        kid = header.get("kid")
        if kid is None:
            candidates = [k for k in self._keys.values() if k.key_type == kty]
            if len(candidates) != 1:
                raise Unauthenticated(
                    "invalid token: it names no signing key (kid) and the identity "
                    "provider publishes several",
                    hint=_LOGIN_HINT,
                )
            key = candidates[0]
        else:
            found = self._keys.get(str(kid))
            if found is None:
                raise KeyRefreshNeeded(
                    f"invalid token: signing key {str(kid)[:64]!r} is not published by "
                    f"the identity provider {self.issuer}",
                    hint=_LOGIN_HINT,
                )
            key = found
        if key.key_type != kty or key.algorithm_name != alg:
            # e.g. an ES256 header on an RSA key: each key verifies its own algorithm only
            raise Unauthenticated(
                f"invalid token: algorithm {alg} does not match its signing key "
                f"({key.key_type}, {key.algorithm_name})",
                hint=_LOGIN_HINT,
            )
        try:
            return jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.client_id,
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("token expired", hint=_LOGIN_HINT) from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated(
                f"invalid token: audience is not {self.client_id!r} (api.oidc_client_id)",
                hint="The token was issued for another client. " + _LOGIN_HINT,
            ) from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated(
                f"invalid token: issuer is not {self.issuer!r}", hint=_LOGIN_HINT
            ) from None
        except jwt.ImmatureSignatureError:
            raise Unauthenticated(
                "invalid token: not valid yet (nbf/iat in the future)", hint=_LOGIN_HINT
            ) from None
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"invalid token: {e}", hint=_LOGIN_HINT) from None

    def unavailable(self) -> Unavailable:
        return Unavailable(
            f"the identity provider {self.issuer} cannot be reached to check the token",
            hint="Try again shortly; the server logs say why the IdP is unreachable.",
        )


__all__ = [
    "ALGORITHMS",
    "LEEWAY_SECONDS",
    "MIN_REFRESH_INTERVAL",
    "KeyRefreshNeeded",
    "OidcFetchError",
    "OidcProvider",
    "is_loopback_url",
]
