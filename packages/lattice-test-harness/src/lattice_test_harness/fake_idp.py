"""A fake OpenID Connect identity provider that speaks real HTTP, for tests of login and
token validation.

Built on Authlib's authorization server (RFC 6749 grants, RFC 7636 PKCE, RFC 8628 device
authorization, RFC 7009 revocation) and joserfc's JWK/JWS, served by ``http.server`` on
127.0.0.1 in a background thread, so the API's JWKS client and the CLI's login talk to
it exactly as to Keycloak or Dex:

* ``/.well-known/openid-configuration`` (discovery) and ``/jwks`` (the public keys);
* ``/authorize``: authorization code with PKCE (S256 only, required for public
  clients). There is no browser and no login page: the request is approved at once
  for :attr:`FakeIdP.login_user` and answered with a redirect to the client's loopback
  ``redirect_uri`` (any port on 127.0.0.1/localhost, RFC 8252) with ``code`` and
  ``state``. ``login_user = None`` denies (``error=access_denied``);
* ``/device_authorization`` + ``/token`` with the device code grant: ``user_code``,
  ``authorization_pending`` until the test calls :meth:`FakeIdP.approve_device`,
  ``slow_down`` when polled faster than ``device_interval``, ``access_denied`` after
  :meth:`FakeIdP.deny_device`, ``expired_token``;
* ``/token`` also for client credentials (the confidential client
  :data:`SERVICE_CLIENT`) and refresh tokens (rotated on use);
* ``/revoke`` (RFC 7009) for refresh and access tokens.

Access tokens are JWTs signed RS256 (or ES256: ``signing_alg="ES256"``, or
:meth:`FakeIdP.add_key`) carrying ``iss``, ``aud``, ``sub``, ``iat``, ``nbf``, ``exp``,
``jti``, ``azp``, ``scope`` and the user's configured claims (``users``), with a
configurable lifetime, audience and issuer. Keys rotate as at a real IdP:
:meth:`FakeIdP.add_key`, :meth:`FakeIdP.use_key`, :meth:`FakeIdP.remove_key` (or
:meth:`FakeIdP.rotate` for all three). :meth:`FakeIdP.token` mints a token directly,
and :meth:`FakeIdP.bad_token` the classic forgeries: wrong audience, wrong issuer,
unknown key, ``alg=none``, HS256 "signed" with the RSA public key, expired.

``hits`` counts the requests per endpoint path (e.g. how often the JWKS was fetched).
Nothing here logs a token.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from authlib.oauth2.rfc6749 import AuthorizationServer, ClientMixin, OAuth2Request
from authlib.oauth2.rfc6749.errors import InvalidRequestError, OAuth2Error
from authlib.oauth2.rfc6749.grants import (
    AuthorizationCodeGrant,
    ClientCredentialsGrant,
    RefreshTokenGrant,
)
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload
from authlib.oauth2.rfc7009 import RevocationEndpoint
from authlib.oauth2.rfc7636 import CodeChallenge
from authlib.oauth2.rfc8628 import (
    DeviceAuthorizationEndpoint,
    DeviceCodeGrant,
    DeviceCredentialDict,
)
from joserfc import jwt as jose_jwt
from joserfc.jwk import ECKey, RSAKey

#: the public client the CLI logs in with (authorization code + PKCE, device code)
PUBLIC_CLIENT = "lattice"
#: a confidential client for the client credentials grant (services, AI agents)
SERVICE_CLIENT = "lattice-service"
SERVICE_SECRET = "lattice-service-secret-0123456789"

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
_PUBLIC_GRANTS = ("authorization_code", DEVICE_GRANT, "refresh_token")
_AUTH_METHODS = ["client_secret_basic", "client_secret_post", "none"]
BAD_TOKEN_KINDS = (
    "wrong_audience",
    "wrong_issuer",
    "unknown_key",
    "alg_none",
    "hs256_public_key",
    "expired",
)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64json(obj: Any) -> str:
    return _b64(json.dumps(obj, separators=(",", ":")).encode())


def _is_loopback_redirect(uri: str) -> bool:
    parts = urlsplit(uri)
    return parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost", "::1")


# --------------------------------------------------------------------------- models


class FakeClient(ClientMixin):
    """A registered client. A public one (no secret) authenticates with ``none`` and
    must use PKCE; its loopback redirect URIs match on any port (RFC 8252 §7.3)."""

    def __init__(
        self,
        client_id: str,
        *,
        secret: str | None = None,
        grant_types: tuple[str, ...] = _PUBLIC_GRANTS,
        redirect_uris: tuple[str, ...] = ("http://127.0.0.1/callback",),
    ) -> None:
        self.client_id = client_id
        self.secret = secret
        self.grant_types = grant_types
        self.redirect_uris = redirect_uris

    @property
    def public(self) -> bool:
        return self.secret is None

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> str:
        return self.redirect_uris[0]

    def get_allowed_scope(self, scope: str | None) -> str:
        return scope or ""

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        if redirect_uri in self.redirect_uris:
            return True
        if not _is_loopback_redirect(redirect_uri):
            return False
        path = urlsplit(redirect_uri).path
        return any(
            _is_loopback_redirect(r) and urlsplit(r).path == path for r in self.redirect_uris
        )

    def check_client_secret(self, client_secret: str) -> bool:
        return self.secret is not None and hmac.compare_digest(client_secret, self.secret)

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        if self.public:
            return method == "none"
        return method in ("client_secret_basic", "client_secret_post")

    def check_response_type(self, response_type: str) -> bool:
        return response_type == "code" and "authorization_code" in self.grant_types

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type in self.grant_types


class _Code:
    """An authorization code (AuthorizationCodeMixin) with its PKCE challenge."""

    def __init__(self, code: str, request: OAuth2Request, user: str) -> None:
        data = request.payload.data
        self.code = code
        self.client_id = request.client.get_client_id()
        self.redirect_uri = request.payload.redirect_uri or ""
        self.scope = request.scope or ""
        self.user = user
        self.code_challenge = data.get("code_challenge")
        self.code_challenge_method = data.get("code_challenge_method")
        self.expires_at = time.time() + 300

    def get_redirect_uri(self) -> str:
        return self.redirect_uri

    def get_scope(self) -> str:
        return self.scope


class _Token:
    """An issued access or refresh token (TokenMixin), for refresh and revocation."""

    def __init__(
        self, value: str, kind: str, client_id: str, user: str | None, scope: str, ttl: float
    ) -> None:
        self.value = value
        self.kind = kind
        self.client_id = client_id
        self.user = user
        self.scope = scope
        self.expires_at = time.time() + ttl
        self.revoked = False

    def check_client(self, client: Any) -> bool:
        return client.get_client_id() == self.client_id

    def get_scope(self) -> str:
        return self.scope

    def get_expires_in(self) -> int:
        return max(0, int(self.expires_at - time.time()))

    def is_expired(self) -> bool:
        return time.time() >= self.expires_at

    def is_revoked(self) -> bool:
        return self.revoked

    def get_user(self) -> str | None:
        return self.user


class _Request(OAuth2Request):
    """An HTTP request of the fake, as Authlib wants it: query and form merged into the
    payload (as Flask's ``request.values``)."""

    def __init__(
        self, method: str, uri: str, headers: Message, args: dict[str, str], form: dict[str, str]
    ) -> None:
        super().__init__(method, uri, headers=headers)
        self._args = args
        self._form = form
        self.payload = BasicOAuth2Payload({**args, **form})

    @property
    def args(self) -> dict[str, str]:
        return self._args

    @property
    def form(self) -> dict[str, str]:
        return self._form


# --------------------------------------------------------------------------- grants


class _S256(CodeChallenge):
    """PKCE, S256 only, required of public clients at the authorization request."""

    DEFAULT_CODE_CHALLENGE_METHOD = "S256"
    SUPPORTED_CODE_CHALLENGE_METHOD = ["S256"]

    def validate_code_challenge(self, grant: Any, redirect_uri: str) -> None:
        data = grant.request.payload.data
        if grant.request.client.public and not data.get("code_challenge"):
            raise InvalidRequestError("PKCE is required: missing 'code_challenge' (S256)")
        if data.get("code_challenge") and data.get("code_challenge_method") != "S256":
            raise InvalidRequestError("code_challenge_method must be S256")
        super().validate_code_challenge(grant, redirect_uri)


def _grants(idp: FakeIdP) -> tuple[type, ...]:
    class AuthCode(AuthorizationCodeGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = _AUTH_METHODS

        def save_authorization_code(self, code: str, request: OAuth2Request) -> None:
            idp._codes[code] = _Code(code, request, str(request.user))

        def query_authorization_code(self, code: str, client: Any) -> _Code | None:
            rec = idp._codes.get(code)
            if rec and rec.client_id == client.get_client_id() and rec.expires_at > time.time():
                return rec
            return None

        def delete_authorization_code(self, rec: _Code) -> None:
            idp._codes.pop(rec.code, None)

        def authenticate_user(self, rec: _Code) -> str:
            return rec.user

    class Refresh(RefreshTokenGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = _AUTH_METHODS
        INCLUDE_NEW_REFRESH_TOKEN = True

        def authenticate_refresh_token(self, refresh_token: str) -> _Token | None:
            rec = idp._tokens.get(refresh_token)
            if rec and rec.kind == "refresh_token" and not rec.revoked and not rec.is_expired():
                return rec
            return None

        def authenticate_user(self, rec: _Token) -> str | None:
            return rec.user

        def revoke_old_credential(self, rec: _Token) -> None:
            rec.revoked = True

    class Device(DeviceCodeGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = _AUTH_METHODS

        def query_device_credential(self, device_code: str) -> Any:
            return idp._devices.get(device_code)

        def query_user_grant(self, user_code: str) -> tuple[str, bool] | None:
            return idp._device_grants.get(user_code)

        def should_slow_down(self, credential: Any) -> bool:
            now = time.monotonic()
            code = credential["device_code"]
            last = idp._last_poll.get(code)
            idp._last_poll[code] = now
            if last is not None and now - last < idp.device_interval:
                idp.slow_downs += 1
                return True
            return False

    class Service(ClientCredentialsGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]

    return AuthCode, Refresh, Device, Service


class _DeviceEndpoint(DeviceAuthorizationEndpoint):
    def __init__(self, server: Any, idp: FakeIdP) -> None:
        super().__init__(server)
        self.idp = idp
        self.INTERVAL = idp.device_interval  # type: ignore[misc]
        self.EXPIRES_IN = idp.device_expires_in  # type: ignore[misc]

    def get_verification_uri(self) -> str:
        return self.idp.issuer + "/device"

    def save_device_credential(self, client_id: str, scope: str, data: dict[str, Any]) -> None:
        cred = DeviceCredentialDict(
            client_id=client_id, scope=scope, expires_at=time.time() + self.EXPIRES_IN, **data
        )
        self.idp._devices[data["device_code"]] = cred
        self.idp._pending_user_codes.append(data["user_code"])
        self.idp._device_event.set()


class _Revocation(RevocationEndpoint):
    CLIENT_AUTH_METHODS = _AUTH_METHODS

    def __init__(self, server: Any, idp: FakeIdP) -> None:
        super().__init__(server)
        self.idp = idp

    def query_token(self, token_string: str, token_type_hint: str | None) -> _Token | None:
        return self.idp._tokens.get(token_string)

    def revoke_token(self, token: _Token, request: Any) -> None:
        token.revoked = True
        self.idp.revoked.append(token.kind)


class _Server(AuthorizationServer):
    def __init__(self, idp: FakeIdP) -> None:
        super().__init__()
        self.idp = idp

    def query_client(self, client_id: str) -> FakeClient | None:
        return self.idp.clients.get(client_id)

    def save_token(self, token: dict[str, Any], request: Any) -> None:
        self.idp._save_token(token, request)

    def create_oauth2_request(self, request: Any) -> OAuth2Request:
        return request

    def handle_response(self, status: int, body: Any, headers: Any) -> tuple[int, Any, Any]:
        return status, body, headers

    def send_signal(self, name: str, *args: Any, **kwargs: Any) -> None:
        pass


# --------------------------------------------------------------------------- the IdP


class FakeIdP:
    """The fake identity provider; start with ``with FakeIdP() as idp:`` (or
    ``start()``/``stop()``). ``issuer`` is its URL (``http://127.0.0.1:PORT/realms/lattice``)."""

    def __init__(
        self,
        *,
        client_id: str = PUBLIC_CLIENT,
        audience: str | None = None,
        login_user: str | None = "alice",
        users: Mapping[str, Mapping[str, Any]] | None = None,
        token_lifetime: float = 300.0,
        refresh_lifetime: float = 3600.0,
        signing_alg: str = "RS256",
        device_interval: float = 1.0,
        device_expires_in: int = 600,
        realm_path: str = "/realms/lattice",
        with_revocation: bool = True,
        redirect_discovery: bool = False,
    ) -> None:
        self.client_id = client_id
        self.audience = audience or client_id
        self.login_user = login_user
        self.users: dict[str, dict[str, Any]] = {
            k: dict(v) for k, v in (users or {"alice": {"tenant": "physics"}}).items()
        }
        self.token_lifetime = token_lifetime
        self.refresh_lifetime = refresh_lifetime
        self.device_interval = device_interval
        self.device_expires_in = device_expires_in
        self.realm_path = realm_path.rstrip("/")
        self.with_revocation = with_revocation
        self.redirect_discovery = redirect_discovery
        self.extra_claims: dict[str, Any] = {}
        self.clients: dict[str, FakeClient] = {
            client_id: FakeClient(client_id),
            SERVICE_CLIENT: FakeClient(
                SERVICE_CLIENT, secret=SERVICE_SECRET, grant_types=("client_credentials",)
            ),
        }
        self.hits: Counter[str] = Counter()
        self.revoked: list[str] = []
        self.slow_downs = 0
        self._keys: dict[str, RSAKey | ECKey] = {}
        self._signing_kid = ""
        self._codes: dict[str, _Code] = {}
        self._tokens: dict[str, _Token] = {}
        self._devices: dict[str, DeviceCredentialDict] = {}
        self._device_grants: dict[str, tuple[str, bool]] = {}
        self._pending_user_codes: list[str] = []
        self._device_event = threading.Event()
        self._last_poll: dict[str, float] = {}
        self._lock = threading.RLock()
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""
        self.use_key(self.add_key(signing_alg))
        self._server = _Server(self)
        self._server.register_token_generator("default", self._generate_token)
        auth_code, refresh, device, service = _grants(self)
        self._server.register_grant(auth_code, [_S256(required=True)])
        self._server.register_grant(refresh)
        self._server.register_grant(device)
        self._server.register_grant(service)
        self._server.register_endpoint(_DeviceEndpoint(self._server, self))
        self._server.register_endpoint(_Revocation(self._server, self))

    # --- lifecycle ------------------------------------------------------------------------

    def start(self, port: int = 0) -> FakeIdP:
        idp = self

        class Handler(_Handler):
            pass

        Handler.idp = idp
        self._http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._http.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> FakeIdP:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def issuer(self) -> str:
        return self.base_url + self.realm_path

    def metadata(self) -> dict[str, Any]:
        """The discovery document (``/.well-known/openid-configuration``)."""
        doc = {
            "issuer": self.issuer,
            "authorization_endpoint": self.issuer + "/authorize",
            "token_endpoint": self.issuer + "/token",
            "device_authorization_endpoint": self.issuer + "/device_authorization",
            "jwks_uri": self.issuer + "/jwks",
            "response_types_supported": ["code"],
            "grant_types_supported": [
                "authorization_code",
                "refresh_token",
                "client_credentials",
                DEVICE_GRANT,
            ],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": _AUTH_METHODS,
            "id_token_signing_alg_values_supported": ["RS256", "ES256"],
            "subject_types_supported": ["public"],
            "scopes_supported": ["openid", "admin", "tenant:admin", "operator", "readonly"],
        }
        if self.with_revocation:
            doc["revocation_endpoint"] = self.issuer + "/revoke"
        return doc

    # --- keys -----------------------------------------------------------------------------

    def add_key(self, alg: str = "RS256", *, kid: str | None = None) -> str:
        """Generate and publish a signing key (RS256: RSA 2048, ES256: P-256); its kid."""
        kid = kid or f"{alg.lower()}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            self._keys[kid] = _generate_key(alg, kid)
        return kid

    def use_key(self, kid: str) -> None:
        """Sign new tokens with ``kid`` (a published key)."""
        with self._lock:
            if kid not in self._keys:
                raise KeyError(kid)
            self._signing_kid = kid

    def remove_key(self, kid: str) -> None:
        """Stop publishing ``kid`` (tokens it signed no longer validate after a refresh)."""
        with self._lock:
            if kid == self._signing_kid:
                raise ValueError("switch the signing key (use_key) before removing it")
            del self._keys[kid]

    def rotate(self, alg: str | None = None, *, remove_old: bool = True) -> str:
        """Add a key, sign with it, and (by default) unpublish the previous one."""
        old = self._signing_kid
        kid = self.add_key(alg or str(self._keys[old].alg))
        self.use_key(kid)
        if remove_old:
            self.remove_key(old)
        return kid

    @property
    def signing_kid(self) -> str:
        return self._signing_kid

    def jwks(self) -> dict[str, Any]:
        with self._lock:
            return {"keys": [k.as_dict(private=False) for k in self._keys.values()]}

    # --- tokens ---------------------------------------------------------------------------

    def claims_for(self, user: str | None, client_id: str, scope: str = "") -> dict[str, Any]:
        now = int(time.time())
        user_claims = dict(self.users.get(user or "", {}))
        scopes = scope.split() + str(user_claims.pop("scope", "")).split()
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "aud": self.audience,
            "sub": user or client_id,
            "azp": client_id,
            "iat": now,
            "nbf": now,
            "exp": now + int(self.token_lifetime),
            "jti": uuid.uuid4().hex,
            "scope": " ".join(dict.fromkeys(scopes)),
        }
        if user:
            claims["preferred_username"] = user
        claims.update(user_claims)
        claims.update(self.extra_claims)
        return claims

    def token(
        self,
        user: str | None = "alice",
        *,
        scope: str = "",
        audience: str | None = None,
        issuer: str | None = None,
        lifetime: float | None = None,
        kid: str | None = None,
        **claims: Any,
    ) -> str:
        """A signed access token for ``user`` (as the token endpoint would issue),
        with any claim overridden."""
        payload = self.claims_for(user, self.client_id, scope)
        if audience is not None:
            payload["aud"] = audience
        if issuer is not None:
            payload["iss"] = issuer
        if lifetime is not None:
            payload["exp"] = int(time.time() + lifetime)
            if lifetime < 0:
                payload["iat"] = payload["nbf"] = int(time.time() + 2 * lifetime)
        payload.update(claims)
        return self._sign(payload, kid or self._signing_kid)

    def _sign(self, claims: dict[str, Any], kid: str, keys: Mapping[str, Any] | None = None) -> str:
        key = (keys or self._keys)[kid]
        alg = str(key.alg)
        return jose_jwt.encode({"alg": alg, "kid": kid, "typ": "JWT"}, claims, key, [alg])

    def bad_token(self, kind: str, user: str = "alice") -> str:
        """A token the API must refuse; ``kind`` is one of :data:`BAD_TOKEN_KINDS`."""
        if kind == "wrong_audience":
            return self.token(user, audience="some-other-client")
        if kind == "wrong_issuer":
            return self.token(user, issuer="https://evil.example.com/realms/lattice")
        if kind == "expired":
            return self.token(user, lifetime=-600)
        if kind == "unknown_key":
            kid = f"unpublished-{uuid.uuid4().hex[:8]}"
            key = _generate_key(str(self._keys[self._signing_kid].alg), kid)
            return self._sign(self.claims_for(user, self.client_id), kid, {kid: key})
        header = {"typ": "JWT", "kid": self._signing_kid}
        payload = _b64json(self.claims_for(user, self.client_id, "admin"))
        if kind == "alg_none":
            return f"{_b64json({**header, 'alg': 'none'})}.{payload}."
        if kind == "hs256_public_key":
            # the algorithm confusion attack: HMAC keyed with the RSA public key's PEM
            secret = self._keys[self._signing_kid].as_pem(private=False)
            signing_input = f"{_b64json({**header, 'alg': 'HS256'})}.{payload}"
            sig = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
            return f"{signing_input}.{_b64(sig)}"
        raise ValueError(f"unknown bad token kind {kind!r}; one of {BAD_TOKEN_KINDS}")

    def _generate_token(
        self,
        grant_type: str,
        client: FakeClient,
        user: str | None = None,
        scope: str | None = None,
        expires_in: int | None = None,
        include_refresh_token: bool = True,
    ) -> dict[str, Any]:
        claims = self.claims_for(user, client.get_client_id(), scope or "")
        token: dict[str, Any] = {
            "token_type": "Bearer",
            "access_token": self._sign(claims, self._signing_kid),
            "expires_in": int(self.token_lifetime),
            "scope": claims["scope"],
        }
        if include_refresh_token:
            token["refresh_token"] = secrets.token_urlsafe(32)
        return token

    def _save_token(self, token: dict[str, Any], request: Any) -> None:
        client_id = request.client.get_client_id()
        user = request.user
        scope = token.get("scope", "")
        self._tokens[token["access_token"]] = _Token(
            token["access_token"], "access_token", client_id, user, scope, self.token_lifetime
        )
        if token.get("refresh_token"):
            self._tokens[token["refresh_token"]] = _Token(
                token["refresh_token"], "refresh_token", client_id, user, scope,
                self.refresh_lifetime,
            )  # fmt: skip

    def expire_refresh_tokens(self) -> None:
        """Make every refresh token issued so far expired (the IdP session ended)."""
        with self._lock:
            for rec in self._tokens.values():
                if rec.kind == "refresh_token":
                    rec.expires_at = time.time() - 1

    # --- device flow helpers --------------------------------------------------------------

    def wait_for_device_request(self, timeout: float = 10.0) -> str:
        """The user code of the next device authorization request (blocks until one)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._pending_user_codes:
                    return self._pending_user_codes.pop(0)
                self._device_event.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no device authorization request arrived")
            self._device_event.wait(remaining)

    def approve_device(self, user_code: str, user: str | None = None) -> None:
        """The user entered ``user_code`` at the verification page and approved."""
        with self._lock:
            self._device_grants[user_code] = (user or self.login_user or "alice", True)

    def deny_device(self, user_code: str) -> None:
        with self._lock:
            self._device_grants[user_code] = ("", False)

    # --- HTTP ------------------------------------------------------------------------------

    def handle(self, method: str, path: str, request: _Request) -> tuple[int, Any, Any]:
        if not path.startswith(self.realm_path + "/"):
            return 404, {"error": "not_found"}, []
        name = path[len(self.realm_path) :]
        server = self._server
        with self._lock:
            if method == "GET" and name == "/.well-known/openid-configuration":
                if self.redirect_discovery:
                    return 302, "", [("Location", "http://127.0.0.1:9/evil-configuration")]
                return 200, self.metadata(), []
            if method == "GET" and name == "/jwks":
                return 200, self.jwks(), []
            if method == "GET" and name == "/authorize":
                try:
                    grant = server.get_consent_grant(request)
                except OAuth2Error as error:
                    return server.handle_error_response(request, error)
                # no login page: approved at once for login_user (None: denied)
                return server.create_authorization_response(request, self.login_user, grant)
            if method == "GET" and name == "/device":
                return 200, "Enter the code shown on your device.", [("Content-Type", "text/plain")]
            if method == "POST" and name == "/token":
                return server.create_token_response(request)
            if method == "POST" and name == "/device_authorization":
                return server.create_endpoint_response("device_authorization", request)
            if method == "POST" and name == "/revoke" and self.with_revocation:
                resp = server.create_endpoint_response("revocation", request)
                return resp if resp is not None else (200, "", [])
        return 404, {"error": "not_found"}, []


def _generate_key(alg: str, kid: str) -> RSAKey | ECKey:
    params = {"kid": kid, "alg": alg, "use": "sig"}
    if alg == "RS256":
        return RSAKey.generate_key(2048, parameters=params)  # type: ignore[arg-type]
    if alg == "ES256":
        return ECKey.generate_key("P-256", parameters=params)  # type: ignore[arg-type]
    raise ValueError(f"unsupported signing algorithm {alg!r} (RS256 or ES256)")


class _Handler(BaseHTTPRequestHandler):
    idp: FakeIdP
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # never log (tokens in URLs)
        pass

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        args = dict(parse_qsl(parts.query, keep_blank_values=True))
        form: dict[str, str] = {}
        if method == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            form = dict(parse_qsl(body, keep_blank_values=True))
        self.idp.hits[parts.path.removeprefix(self.idp.realm_path)] += 1
        uri = self.idp.base_url + self.path
        request = _Request(method, uri, self.headers, args, form)
        status, body_obj, headers = self.idp.handle(method, parts.path, request)
        headers = list(headers or [])
        if isinstance(body_obj, dict | list):
            data = json.dumps(body_obj).encode()
            if not any(k.lower() == "content-type" for k, _ in headers):
                headers.append(("Content-Type", "application/json"))
        else:
            data = str(body_obj or "").encode()
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")


@contextlib.contextmanager
def fake_idp(**kwargs: Any) -> Iterator[FakeIdP]:
    with FakeIdP(**kwargs) as idp:
        yield idp


def main(argv: list[str] | None = None) -> None:
    """``python -m lattice_test_harness.fake_idp``: the fake IdP as a process, for
    `lattice dev up --secure`. Device logins are approved at once for ``--user``
    (there is no login page), so ``lattice login --device`` works on a headless
    machine; the confidential client SERVICE_CLIENT gets tokens by client credentials
    (with ``scope=admin``: a system admin)."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="fake-idp", description=main.__doc__)
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0 = any)")
    p.add_argument("--user", default="alice", help="who every login is (default: alice)")
    p.add_argument("--tenant", default="default", help="the user's tenant claim")
    p.add_argument(
        "--info-file",
        help="write {issuer, service_client, service_secret} (JSON, mode 0600) once serving",
    )
    args = p.parse_args(argv)
    idp = FakeIdP(login_user=args.user, users={args.user: {"tenant": args.tenant}})
    idp.start(args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def approve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                idp.approve_device(idp.wait_for_device_request(timeout=0.5))

    threading.Thread(target=approve, daemon=True).start()
    if args.info_file:
        import os

        info = {
            "issuer": idp.issuer,
            "service_client": SERVICE_CLIENT,
            "service_secret": SERVICE_SECRET,
        }
        tmp = args.info_file + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.replace(tmp, args.info_file)
    print(f"fake IdP serving {idp.issuer} (logins as {args.user})", flush=True)
    stop.wait()
    idp.stop()


if __name__ == "__main__":
    main()


__all__ = [
    "BAD_TOKEN_KINDS",
    "PUBLIC_CLIENT",
    "SERVICE_CLIENT",
    "SERVICE_SECRET",
    "FakeClient",
    "FakeIdP",
    "fake_idp",
]
