"""Logging in to a Lattice server: OIDC flows, the token cache and silent refresh.

The server names its identity provider at ``GET /api/v1/auth/discovery`` (issuer, client
id, and the IdP's authorization, token, device authorization and revocation endpoints),
so the CLI needs nothing but the server URL:

* :func:`login_browser` -- authorization code with PKCE (S256): a one-shot listener on
  ``127.0.0.1:<free port>`` receives the redirect, the code is exchanged for tokens;
* :func:`login_device` -- the device authorization grant (RFC 8628) for nodes without a
  browser: print the verification URL and user code, poll the token endpoint
  (``authorization_pending``, ``slow_down`` adds 5 s to the interval);
* :func:`refresh` and :func:`revoke` (RFC 7009, best effort at logout).

Tokens are cached per server in ``tokens.json`` next to the config file
(``$XDG_CONFIG_HOME/lattice`` or ``~/.config/lattice``), mode 0600 (a wider mode is
repaired with a warning). :class:`CachedToken` is the token provider the CLI gives the
SDK: the cached access token, silently refreshed when it is expired or about to be, or a
``Not logged in`` error with ``Hint: run `lattice login```.

Standard library only (urllib, http.server): ``lattice status`` must start fast. Never
prints or logs a token.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Callable, Mapping
from typing import Any

# urllib, http.server, hashlib, secrets and threading are imported where they are used:
# every API command reads the token cache (this module), and `lattice status` must not
# pay ~35 ms for urllib when the cached token is still valid.

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
#: refresh this many seconds before the access token expires
REFRESH_MARGIN = 30.0
#: RFC 8628 §3.5: slow_down adds 5 seconds to the polling interval
SLOW_DOWN_STEP = 5.0
HTTP_TIMEOUT = 30.0
LOGIN_HINT = "Run `lattice login`."


class LoginError(Exception):
    """A login, refresh or logout step failed; ``hint`` says what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


# --------------------------------------------------------------------------- token cache


def tokens_path(env: Mapping[str, str]) -> str:
    """``$XDG_CONFIG_HOME/lattice/tokens.json`` (default ``~/.config/lattice/``)."""
    base = env.get("XDG_CONFIG_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".config"
    )
    return os.path.join(base, "lattice", "tokens.json")


class TokenStore:
    """``tokens.json``: ``{"servers": {SERVER_URL: entry}}``; written atomically, 0600."""

    def __init__(self, path: str, warn: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.warn = warn or (lambda message: None)

    def _check_mode(self) -> None:
        try:
            mode = stat.S_IMODE(os.stat(self.path).st_mode)
        except FileNotFoundError:
            return
        if mode & 0o077:
            os.chmod(self.path, 0o600)
            self.warn(
                f"{self.path} was readable by other users (mode {mode:04o}); its mode is now 0600"
            )

    def load(self) -> dict[str, Any]:
        self._check_mode()
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return {"servers": {}}
        except (OSError, ValueError) as exc:
            self.warn(f"ignoring the unreadable token cache {self.path}: {exc}")
            return {"servers": {}}
        if not isinstance(data, dict) or not isinstance(data.get("servers"), dict):
            return {"servers": {}}
        return data

    def get(self, server: str) -> dict[str, Any] | None:
        entry = self.load()["servers"].get(server)
        return entry if isinstance(entry, dict) else None

    def put(self, server: str, entry: dict[str, Any]) -> None:
        data = self.load()
        data["servers"][server] = entry
        self._write(data)

    def remove(self, server: str) -> dict[str, Any] | None:
        data = self.load()
        entry = data["servers"].pop(server, None)
        if entry is not None:
            self._write(data)
        return entry

    def _write(self, data: dict[str, Any]) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2, sort_keys=True)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.chmod(self.path, 0o600)


# --------------------------------------------------------------------------- HTTP


def _read_json(resp: Any) -> Any:
    raw = resp.read()
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}


#: the TLS context of every request here (the server's discovery document, the IdP):
#: set from the CLI's ca_cert by the login commands (:func:`use_ssl_context`)
_SSL_CONTEXT: Any = None


def use_ssl_context(context: Any) -> None:
    global _SSL_CONTEXT
    _SSL_CONTEXT = context


def get_json(url: str, *, timeout: float = HTTP_TIMEOUT) -> Any:
    import urllib.request

    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout, context=_SSL_CONTEXT) as resp:
        return _read_json(resp)


def post_form(url: str, data: Mapping[str, str], *, timeout: float = HTTP_TIMEOUT) -> Any:
    """POST a form; the JSON answer, also for OAuth error answers (4xx with ``error``)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    body = urllib.parse.urlencode(data).encode()
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/x-www-form-urlencoded",
            "Accept": "application/json",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=_SSL_CONTEXT) as resp:
            return _read_json(resp)
    except urllib.error.HTTPError as exc:
        answer = _read_json(exc)
        if isinstance(answer, dict) and answer.get("error"):
            return answer
        raise LoginError(f"{url} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LoginError(f"cannot reach {url}: {reason}") from None


def discover(server: str, *, timeout: float = HTTP_TIMEOUT) -> dict[str, Any]:
    """The server's login discovery document; LoginError when it has no IdP."""
    import urllib.error

    url = server.rstrip("/") + "/api/v1/auth/discovery"
    try:
        doc = get_json(url, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise LoginError(
            f"{server} answered HTTP {exc.code} for its login discovery document",
            hint="Check that --endpoint / LATTICE_ENDPOINT names a Lattice API server.",
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LoginError(
            f"cannot reach the Lattice API at {server}: {reason}",
            hint="Check --endpoint / LATTICE_ENDPOINT, or start a cluster with `lattice dev up`.",
        ) from None
    if not isinstance(doc, dict) or not doc.get("issuer"):
        mode = doc.get("mode") if isinstance(doc, dict) else ""
        hint = (
            "This server trusts every caller (development mode): no login is needed."
            if mode == "none"
            else "Ask the administrator for a token and set LATTICE_TOKEN (or `token:` in "
            "the config file), or configure api.oidc_issuer on the server."
        )
        raise LoginError(f"{server} has no identity provider configured", hint=hint)
    return doc


def _oauth_error(answer: Mapping[str, Any], what: str) -> LoginError:
    error = str(answer.get("error") or "error")
    description = str(answer.get("error_description") or "").strip()
    text = f"{what} failed: {error}" + (f" ({description})" if description else "")
    return LoginError(text, hint=LOGIN_HINT)


def _token_entry(
    answer: Mapping[str, Any],
    doc: Mapping[str, Any],
    now: float,
    old: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What the cache keeps from a token response (the refresh token carried over when
    the IdP did not rotate it)."""
    old = old or {}
    access = answer.get("access_token")
    if not isinstance(access, str) or not access:
        raise LoginError("the identity provider answered without an access token")
    expires_in = answer.get("expires_in")
    expires_at = jwt_expiry(access)
    if expires_at is None and isinstance(expires_in, int | float):
        expires_at = now + float(expires_in)
    return {
        "access_token": access,
        "refresh_token": answer.get("refresh_token") or old.get("refresh_token") or "",
        "expires_at": expires_at,
        "scope": answer.get("scope") or old.get("scope") or "",
        "issuer": doc.get("issuer", ""),
        "client_id": doc.get("client_id", ""),
        "token_endpoint": doc.get("token_endpoint", ""),
        "revocation_endpoint": doc.get("revocation_endpoint", ""),
        "obtained_at": now,
    }


def jwt_expiry(token: str) -> float | None:
    """The ``exp`` of a JWT, read without checking the signature (only to know when to
    refresh; the server checks everything)."""
    claims = jwt_claims(token)
    exp = claims.get("exp")
    return float(exp) if isinstance(exp, int | float) else None


def jwt_claims(token: str) -> dict[str, Any]:
    import base64

    parts = token.split(".")
    if len(parts) != 3:
        return {}
    try:
        payload = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        claims = json.loads(payload)
    except ValueError:
        return {}
    return claims if isinstance(claims, dict) else {}


# --------------------------------------------------------------------------- PKCE


def pkce_pair() -> tuple[str, str]:
    """(code_verifier, S256 code_challenge) per RFC 7636."""
    import base64
    import hashlib
    import secrets

    verifier = secrets.token_urlsafe(64)[:96]
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    challenge = base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
    return verifier, challenge


class _Callback:
    """A one-shot HTTP listener on 127.0.0.1:<free port> for the IdP's redirect."""

    PATH = "/callback"

    def __init__(self) -> None:
        import threading
        import urllib.parse
        from http.server import BaseHTTPRequestHandler, HTTPServer

        self.params: dict[str, str] | None = None
        self.done = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # the URL holds the code
                pass

            def do_GET(self) -> None:
                parts = urllib.parse.urlsplit(self.path)
                if parts.path != owner.PATH:
                    self.send_error(404)
                    return
                params = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
                ok = "code" in params
                body = (
                    "Lattice: you are logged in. You can close this window."
                    if ok
                    else "Lattice: login failed; see the terminal."
                ).encode()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if owner.params is None:
                    owner.params = params
                    owner.done.set()

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def redirect_uri(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.PATH}"

    def __enter__(self) -> _Callback:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait(self, timeout: float) -> dict[str, str]:
        if not self.done.wait(timeout):
            raise LoginError(
                f"no answer from the browser within {timeout:g} s",
                hint="Open the URL above in a browser, or use `lattice login --device`.",
            )
        assert self.params is not None
        return self.params


def login_browser(
    doc: Mapping[str, Any],
    *,
    scope: str = "openid",
    open_browser: bool = True,
    say: Callable[[str], None] = print,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Authorization code + PKCE; the cache entry for the tokens obtained."""
    import secrets
    import urllib.parse

    endpoint = str(doc.get("authorization_endpoint") or "")
    if not endpoint or not doc.get("token_endpoint"):
        raise LoginError(
            "the identity provider publishes no authorization endpoint",
            hint="Use `lattice login --device`.",
        )
    verifier, challenge = pkce_pair()
    state = secrets.token_urlsafe(24)
    with _Callback() as callback:
        query = urllib.parse.urlencode(
            {
                "response_type": "code",
                "client_id": doc["client_id"],
                "redirect_uri": callback.redirect_uri,
                "scope": scope,
                "state": state,
                "code_challenge": challenge,
                "code_challenge_method": "S256",
            }
        )
        url = f"{endpoint}{'&' if '?' in endpoint else '?'}{query}"
        say("Open this URL in a browser to log in:")
        say(f"  {url}")
        if open_browser:
            import webbrowser

            with contextlib.suppress(Exception):
                if webbrowser.open(url):
                    say("(a browser window was opened)")
        say(f"Waiting for the login on {callback.redirect_uri} ...")
        params = callback.wait(timeout)
    if params.get("state") != state:
        raise LoginError("the login answer does not match this request (state)", LOGIN_HINT)
    if "error" in params:
        raise _oauth_error(params, "login")
    answer = post_form(
        str(doc["token_endpoint"]),
        {
            "grant_type": "authorization_code",
            "code": params.get("code", ""),
            "redirect_uri": callback.redirect_uri,
            "client_id": str(doc["client_id"]),
            "code_verifier": verifier,
        },
    )
    if answer.get("error"):
        raise _oauth_error(answer, "the code exchange")
    return _token_entry(answer, doc, time.time())


# --------------------------------------------------------------------------- device grant


def login_device(
    doc: Mapping[str, Any],
    *,
    scope: str = "openid",
    say: Callable[[str], None] = print,
    timeout: float = 600.0,
    sleep: Callable[[float], None] = time.sleep,
    slow_down_step: float = SLOW_DOWN_STEP,
) -> dict[str, Any]:
    """The device authorization grant (RFC 8628); the cache entry for the tokens."""
    endpoint = str(doc.get("device_authorization_endpoint") or "")
    if not endpoint:
        raise LoginError(
            "the identity provider does not offer the device flow",
            hint="Log in with a browser: `lattice login` (or `--no-browser` to copy the URL).",
        )
    client_id = str(doc["client_id"])
    start = post_form(endpoint, {"client_id": client_id, "scope": scope})
    if start.get("error"):
        raise _oauth_error(start, "the device authorization request")
    uri = start.get("verification_uri") or start.get("verification_url") or ""
    say(f"To log in, open {uri} and enter the code: {start.get('user_code', '')}")
    if start.get("verification_uri_complete"):
        say(f"  (or open {start['verification_uri_complete']})")
    interval = float(start.get("interval") or 5)
    expires = float(start.get("expires_in") or timeout)
    deadline = time.monotonic() + min(expires, timeout)
    while True:
        sleep(interval)
        answer = post_form(
            str(doc["token_endpoint"]),
            {
                "grant_type": DEVICE_GRANT,
                "device_code": start["device_code"],
                "client_id": client_id,
            },
        )
        error = answer.get("error")
        if not error:
            return _token_entry(answer, doc, time.time())
        if error == "authorization_pending":
            pass
        elif error == "slow_down":
            interval += slow_down_step
        elif error == "access_denied":
            raise LoginError("the login was denied at the identity provider", LOGIN_HINT)
        elif error == "expired_token":
            raise LoginError("the code expired before the login was approved", LOGIN_HINT)
        else:
            raise _oauth_error(answer, "the device login")
        if time.monotonic() >= deadline:
            raise LoginError(
                f"the login was not approved within {min(expires, timeout):g} s", LOGIN_HINT
            )


# --------------------------------------------------------------------------- refresh, revoke


def refresh(entry: Mapping[str, Any]) -> dict[str, Any]:
    """New tokens from the entry's refresh token; LoginError when that is not possible."""
    token = entry.get("refresh_token")
    endpoint = entry.get("token_endpoint")
    if not token or not endpoint:
        raise LoginError("no refresh token is cached", LOGIN_HINT)
    answer = post_form(
        str(endpoint),
        {
            "grant_type": "refresh_token",
            "refresh_token": str(token),
            "client_id": str(entry.get("client_id", "")),
        },
    )
    if answer.get("error"):
        raise _oauth_error(answer, "refreshing the token")
    return _token_entry(answer, entry, time.time(), entry)


def revoke(entry: Mapping[str, Any]) -> bool:
    """Revoke the refresh and access tokens at the IdP (RFC 7009), best effort; whether
    the IdP has a revocation endpoint and accepted the request."""
    endpoint = entry.get("revocation_endpoint")
    if not endpoint:
        return False
    ok = True
    for hint in ("refresh_token", "access_token"):
        token = entry.get(hint)
        if not token:
            continue
        try:
            answer = post_form(
                str(endpoint),
                {
                    "token": str(token),
                    "token_type_hint": hint,
                    "client_id": str(entry.get("client_id", "")),
                },
                timeout=10.0,
            )
        except LoginError:
            ok = False
            continue
        ok = ok and not answer.get("error")
    return ok


# --------------------------------------------------------------------------- the provider


class CachedToken:
    """The SDK token provider for one server: the cached access token, refreshed (and
    written back) when it expires within :data:`REFRESH_MARGIN` seconds. Raises the
    SDK's LatticeAuthError with ``Hint: Run `lattice login`.`` when it cannot."""

    def __init__(self, server: str, store: TokenStore, entry: dict[str, Any]) -> None:
        self.server = server
        self.store = store
        self.entry = entry

    def __call__(self) -> str:
        expires_at = self.entry.get("expires_at")
        token = str(self.entry.get("access_token") or "")
        if token and (
            not isinstance(expires_at, int | float) or expires_at - time.time() > REFRESH_MARGIN
        ):
            return token
        try:
            fresh = refresh(self.entry)
        except LoginError as exc:
            from lattice_sdk import LatticeAuthError

            when = ""
            if isinstance(expires_at, int | float):
                when = time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(expires_at))
            raise LatticeAuthError(
                f"Not logged in: the cached token for {self.server} expired{when} "
                f"and could not be refreshed ({exc.message})",
                status_code=401,
                code="unauthenticated",
                hint=LOGIN_HINT,
            ) from None
        self.entry = fresh
        self.store.put(self.server, fresh)
        return str(fresh["access_token"])


__all__ = [
    "DEVICE_GRANT",
    "CachedToken",
    "LoginError",
    "TokenStore",
    "discover",
    "jwt_claims",
    "jwt_expiry",
    "login_browser",
    "login_device",
    "pkce_pair",
    "refresh",
    "revoke",
    "tokens_path",
]
