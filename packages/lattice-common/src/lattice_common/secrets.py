"""Secret references: one resolver for every secret a Lattice process reads.

Why this module exists: the specification keeps sensitive values out of configuration
files ("Configuration files reference secrets by path, never by value"). A config field
that holds a secret (``api.oidc_hmac_secret``, ``api.agent_token``,
``network.fabric_manager_token``, ``accounting.waldur_token``) therefore takes either
the value itself (development, back compatibility) or a *reference*:

``env://NAME``
    the environment variable ``NAME`` of the process (set by systemd
    ``EnvironmentFile=``, Kubernetes, ...). The agent does not pass variables named by a
    reference on to the jobs it starts.
``file:///abs/path``
    the contents of a local file, one trailing newline removed. The file must not be
    readable or writable by group or others (``chmod 600``), else it is refused.
``vault://<mount>/<path>#<key>``
    key ``<key>`` of a KV version 2 secret in HashiCorp Vault or OpenBao, read with
    ``GET /v1/<mount>/data/<path>`` after an AppRole login (``POST
    /v1/auth/approle/login`` with ``secrets.vault_role_id`` and the secret id from the
    ``VAULT_SECRET_ID`` environment variable). With ``secrets.vault_kv_mount`` set the
    reference is a path inside that mount (``vault://lattice/waldur-token``, the
    specification's form); ``secrets.vault_path_prefix`` is put before every path.
    Without ``#key`` the secret must hold exactly one key. The token is renewed before
    it expires and the role logs in again when renewal fails or the server answers 403.

Anything else without a ``scheme://`` is a plain value and stays as it is; an unknown
scheme is refused (a typo must not become the secret).

Results are :class:`pydantic.SecretStr`. The clear text never appears in a ``repr``, a
log line, an error message or a metric: errors name the reference, the file or the
server, never the value, the secret id or the Vault token.

Rotation: :meth:`SecretResolver.watch` registers a reference and a callback; the
resolver polls every ``secrets.refresh_interval_seconds`` (0 = never) and calls back
with the new value when it changed (:meth:`SecretResolver.refresh` does one round now).
Polling rather than SIGHUP so that a rotation in Vault reaches every process without an
operator; lattice-server uses it to swap the HMAC secret and the agent token of a
running API.

The HTTP client is the standard library's (no extra dependency; config loading is
synchronous); the async methods run it in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import ssl
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from lattice_common.errors import Unavailable, ValidationError
from lattice_common.net import http_url_or_empty

log = logging.getLogger("lattice.secrets")


class SecretsConfig(BaseModel):
    """Where secret references resolve (lattice_common.secrets): ``env://NAME``,
    ``file:///path`` and ``vault://<mount>/<path>#<key>`` (Vault or OpenBao KV v2 with
    AppRole). The AppRole secret id comes from the ``VAULT_SECRET_ID`` environment
    variable only. Defined here, not in lattice_common.config (which re-exports it), so
    that the resolver never imports the configuration module that uses it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    vault_address: str = Field(
        default="", description="Vault/OpenBao URL, e.g. https://vault:8200; empty = none"
    )
    vault_role_id: str = Field(default="", description="AppRole role_id (not a secret)")
    vault_kv_mount: str = Field(
        default="",
        description="KV v2 mount; empty = the first segment of each vault:// path is the mount",
    )
    vault_path_prefix: str = Field(
        default="", description="put before every path inside the mount, e.g. lattice/prod"
    )
    vault_ca_cert: str = Field(default="", description="CA bundle (PEM) for an https address")
    timeout_seconds: float = Field(default=5.0, gt=0, description="per request to the server")
    refresh_interval_seconds: float = Field(
        default=300.0, ge=0, description="re-read watched references (rotation); 0 = never"
    )

    @field_validator("vault_address")
    @classmethod
    def _vault_address(cls, v: str) -> str:
        return http_url_or_empty(v)


SCHEMES = ("env", "file", "vault")
#: where the AppRole secret id comes from (never from the config file)
SECRET_ID_ENV = "VAULT_SECRET_ID"
_REF = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
_HINT_FORMS = "Use env://NAME, file:///absolute/path or vault://<mount>/<path>#<key>."

#: environment variables named by resolved env:// references (never passed to jobs:
#: lattice_common.config.is_config_env)
REFERENCED_ENV: set[str] = set()
#: secret values this process knows (config secrets, the AppRole secret id, the Vault
#: token): lattice_common.logging masks them in every log line as a last line of defence
_KNOWN: set[str] = set()
_LONGEST_FIRST: tuple[str, ...] = ()  # _KNOWN as redact() walks it, kept by remember()
_MASK = "**********"


def remember(value: str | SecretStr | None) -> None:
    """Mask ``value`` in every log line of this process from now on (values shorter
    than 6 characters are not, they would mask ordinary words)."""
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    global _LONGEST_FIRST
    if text and len(text) >= 6 and text not in _KNOWN:
        _KNOWN.add(text)
        # longest first: a secret that contains another must not leave its rest in clear
        _LONGEST_FIRST = tuple(sorted(_KNOWN, key=len, reverse=True))


def redact(text: str) -> str:
    """``text`` with every remembered secret replaced by ``**********``."""
    for value in _LONGEST_FIRST:  # every log line passes here: no sorting per call
        if value in text:
            text = text.replace(value, _MASK)
    return text


class SecretError(ValidationError):
    """A reference that cannot be resolved as written (bad form, missing variable,
    file too open, no such key). The message names the reference, never a value."""


class SecretUnavailable(Unavailable):
    """The secrets manager could not be reached or refused the login."""


@dataclass(frozen=True)
class SecretRef:
    scheme: str
    path: str
    key: str = ""

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        return f"{self.scheme}://{self.path}" + (f"#{self.key}" if self.key else "")


def is_reference(value: str | SecretStr | None) -> bool:
    """Whether ``value`` is written as ``scheme://...`` (known scheme or not)."""
    if value is None:
        return False
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    return bool(_REF.match(text.strip()))


def parse_ref(ref: str) -> SecretRef:
    """The parts of a reference; :class:`SecretError` for an unknown scheme or a
    malformed one. Never called with a plain value (see :func:`is_reference`)."""
    m = _REF.match(ref.strip())
    if not m:
        raise SecretError("not a secret reference", hint=_HINT_FORMS)
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme not in SCHEMES:
        raise SecretError(
            f"unknown secret reference scheme {scheme!r}",
            details={"scheme": scheme},
            hint=_HINT_FORMS,
        )
    if scheme == "env":
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rest):
            raise SecretError(
                f"invalid environment variable name in env://{rest}",
                hint="Write env://NAME with letters, digits and underscores.",
            )
        return SecretRef("env", rest)
    if scheme == "file":
        if not rest.startswith("/"):
            raise SecretError(
                f"file://{rest} is not an absolute path",
                hint="Write file:///absolute/path (three slashes).",
            )
        return SecretRef("file", urllib.parse.unquote(rest))
    path, _, key = rest.partition("#")
    path = path.strip("/")
    if not path or "//" in path or any(p in (".", "..") for p in path.split("/")):
        raise SecretError(
            f"invalid Vault path in vault://{rest}", hint="Write vault://<mount>/<path>#<key>."
        )
    return SecretRef("vault", path, key)


class _Vault:
    """A minimal KV v2 + AppRole client (urllib). Thread-safe; one token per resolver."""

    def __init__(self, cfg: SecretsConfig, secret_id: str | None) -> None:
        self.address = cfg.vault_address.rstrip("/")
        self.role_id = cfg.vault_role_id
        self.mount = cfg.vault_kv_mount.strip("/")
        self.prefix = cfg.vault_path_prefix.strip("/")
        self.timeout = cfg.timeout_seconds
        self._secret_id = SecretStr(secret_id) if secret_id else None
        remember(self._secret_id)
        self._token: SecretStr | None = None
        self._expires = 0.0  # monotonic; 0 = no expiry
        self._ttl = 0.0
        self._renewable = False
        self._lock = threading.Lock()
        self._ssl = ssl.create_default_context(cafile=cfg.vault_ca_cert or None)

    # --- HTTP -------------------------------------------------------------------------

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, token: bool = True
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Accept": "application/json"}
        if token and self._token is not None:
            headers["X-Vault-Token"] = self._token.get_secret_value()
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.address + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(
                req,
                timeout=self.timeout,
                context=self._ssl if self.address.startswith("https") else None,
            ) as r:
                return r.status, _json(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _json(e.read())
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", None) or e
            raise SecretUnavailable(
                f"secrets manager at {self.address} is unreachable: {_reason(reason)}",
                details={"address": self.address},
                hint="Check secrets.vault_address, the network and that the server is "
                "unsealed; secrets.timeout_seconds bounds each request.",
            ) from None

    # --- AppRole ------------------------------------------------------------------------

    def _login(self) -> None:
        if not self.role_id:
            raise SecretError(
                "a vault:// reference needs secrets.vault_role_id",
                hint="Set secrets.vault_role_id (LATTICE_SECRETS__VAULT_ROLE_ID).",
            )
        if self._secret_id is None:
            raise SecretError(
                f"a vault:// reference needs the AppRole secret id in {SECRET_ID_ENV}",
                hint=f"Set {SECRET_ID_ENV} in the service's environment (systemd "
                "EnvironmentFile=), never in the config file.",
            )
        status, out = self._call(
            "POST",
            "/v1/auth/approle/login",
            {"role_id": self.role_id, "secret_id": self._secret_id.get_secret_value()},
            token=False,
        )
        auth = out.get("auth") if status == 200 else None
        if not isinstance(auth, dict) or not auth.get("client_token"):
            raise SecretUnavailable(
                f"AppRole login at {self.address} refused (HTTP {status}): {_errors(out)}",
                details={"address": self.address, "status": status},
                hint=f"Check secrets.vault_role_id and {SECRET_ID_ENV} (a secret id can "
                "expire or run out of uses).",
            )
        self._token = SecretStr(str(auth["client_token"]))
        remember(self._token)
        self._set_lease(auth)
        log.info("logged in to %s with AppRole (token TTL %ss)", self.address, self._ttl or "-")

    def _set_lease(self, auth: dict[str, Any]) -> None:
        ttl = float(auth.get("lease_duration") or 0)
        self._ttl = ttl
        self._renewable = bool(auth.get("renewable"))
        self._expires = time.monotonic() + ttl if ttl > 0 else 0.0

    def _ensure_token(self) -> None:
        if self._token is None:
            self._login()
            return
        if not self._expires:
            return
        left = self._expires - time.monotonic()
        if left > max(1.0, self._ttl / 3):
            return
        if self._renewable and left > 0.5:
            status, out = self._call("POST", "/v1/auth/token/renew-self", {})
            auth = out.get("auth") if status == 200 else None
            if isinstance(auth, dict):
                self._set_lease(auth)
                # a token at its max TTL renews to what is left: log in again when short
                if self._expires - time.monotonic() > max(1.0, self._ttl / 3):
                    return
        self._login()

    # --- KV v2 --------------------------------------------------------------------------

    def read(self, ref: SecretRef) -> tuple[str, int]:
        """The value of ``ref``'s key and the secret's version."""
        if not self.address:
            raise SecretError(
                f"{ref} needs secrets.vault_address",
                hint="Set secrets.vault_address (LATTICE_SECRETS__VAULT_ADDRESS) to the "
                "Vault/OpenBao URL.",
            )
        mount, path = self._split(ref)
        url_path = f"/v1/{_quote(mount)}/data/{_quote(path)}"
        with self._lock:
            self._ensure_token()
            status, out = self._call("GET", url_path)
            if status == 403:  # token revoked or expired early: log in once more
                self._login()
                status, out = self._call("GET", url_path)
        if status == 404:
            raise SecretError(
                f"secret {ref} not found in {self.address}",
                details={"reference": str(ref)},
                hint=f"Write it with `bao kv put {mount}/{path} ...` or fix the path.",
            )
        if status == 403:
            raise SecretUnavailable(
                f"permission denied reading {ref} from {self.address}",
                details={"reference": str(ref)},
                hint=f"The AppRole's policy must allow read on {mount}/data/{path}.",
            )
        if status != 200:
            raise SecretUnavailable(
                f"reading {ref} from {self.address} failed (HTTP {status}): {_errors(out)}",
                details={"reference": str(ref), "status": status},
                hint="Check the server's health (bao status).",
            )
        data = (out.get("data") or {}) if isinstance(out, dict) else {}
        values = data.get("data") if isinstance(data, dict) else None
        version = int(
            ((data.get("metadata") or {}) if isinstance(data, dict) else {}).get("version") or 0
        )
        if not isinstance(values, dict):
            raise SecretError(
                f"secret {ref} has no data (deleted version?)",
                details={"reference": str(ref)},
                hint="Write a new version or undelete it.",
            )
        key = ref.key
        if not key:
            if len(values) != 1:
                raise SecretError(
                    f"secret {ref} holds {len(values)} keys; name one with #key",
                    details={"keys": sorted(values)},
                    hint=f"Write {ref}#<key>, one of: {', '.join(sorted(values))}.",
                )
            key = next(iter(values))
        if key not in values:
            raise SecretError(
                f"key {key!r} not in secret {ref.scheme}://{ref.path}",
                details={"keys": sorted(values)},
                hint=f"Keys there: {', '.join(sorted(values)) or 'none'}.",
            )
        return str(values[key]), version

    def _split(self, ref: SecretRef) -> tuple[str, str]:
        parts = ref.path.split("/")
        if self.mount:
            mount, rest = self.mount, parts
        else:
            if len(parts) < 2:
                raise SecretError(
                    f"{ref} names no path inside a mount",
                    hint="Write vault://<mount>/<path>#<key> (e.g. vault://secret/lattice/"
                    "agent#token), or set secrets.vault_kv_mount.",
                )
            mount, rest = parts[0], parts[1:]
        path = "/".join([*(self.prefix.split("/") if self.prefix else []), *rest])
        return mount, path


def _json(raw: bytes) -> dict[str, Any]:
    try:
        out = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _errors(out: dict[str, Any]) -> str:
    errs = out.get("errors")
    if isinstance(errs, list) and errs:
        return "; ".join(" ".join(str(e).split()) for e in errs)[:300]
    return "no details"


def _reason(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


def _quote(path: str) -> str:
    return urllib.parse.quote(path, safe="/")


OnChange = Callable[[SecretStr], Awaitable[None] | None]


class SecretResolver:
    """Resolves references (see the module docstring) and watches them for rotation.

    ``config`` is the ``secrets`` section (Vault address, role, mount, timeout, refresh
    interval); ``env`` defaults to ``os.environ`` (read for env:// and
    ``VAULT_SECRET_ID``)."""

    def __init__(
        self, config: SecretsConfig | None = None, *, env: Mapping[str, str] | None = None
    ) -> None:
        self.config = config or SecretsConfig()
        self.env = os.environ if env is None else env
        remember(self.env.get(SECRET_ID_ENV))  # masked in logs even when unused
        self._vault: _Vault | None = None
        self._watches: dict[str, tuple[SecretRef, str, list[OnChange]]] = {}
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"SecretResolver(vault={self.config.vault_address!r}, watching={len(self._watches)})"

    # --- resolving ----------------------------------------------------------------------

    def resolve(self, value: str | SecretStr) -> SecretStr:
        """The secret ``value`` refers to; a plain value is returned as it is."""
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        if not is_reference(text):
            return SecretStr(text)
        ref = parse_ref(text)
        out = self._read(ref)
        remember(out)
        if is_reference(out):
            raise SecretError(
                f"{ref} resolves to another reference",
                hint="A secret reference must lead to the value itself.",
            )
        return SecretStr(out)

    async def aresolve(self, value: str | SecretStr) -> SecretStr:
        return await asyncio.to_thread(self.resolve, value)

    def _read(self, ref: SecretRef) -> str:
        if ref.scheme == "env":
            val = self.env.get(ref.path)
            if val is None or not val.strip():
                raise SecretError(
                    f"environment variable {ref.path} (from {ref}) is not set",
                    details={"reference": str(ref)},
                    hint=f"Set {ref.path} in the service's environment.",
                )
            REFERENCED_ENV.add(ref.path)
            return val
        if ref.scheme == "file":
            return _read_file(ref)
        if self._vault is None:
            self._vault = _Vault(self.config, self.env.get(SECRET_ID_ENV))
        return self._vault.read(ref)[0]

    # --- rotation -----------------------------------------------------------------------

    def watch(self, ref: str, on_change: OnChange, current: SecretStr | None = None) -> None:
        """Call ``on_change(new_value)`` whenever the secret behind ``ref`` changes
        (checked every ``refresh_interval_seconds`` once :meth:`start` ran). A plain
        value is not watched. ``current`` is the value in use (what the first round
        compares with); without it the first round only records the value."""
        if not is_reference(ref):
            return
        parsed = parse_ref(ref)
        key = str(parsed)
        if key in self._watches:
            self._watches[key][2].append(on_change)
        else:
            digest = _digest(current.get_secret_value()) if current is not None else ""
            self._watches[key] = (parsed, digest, [on_change])

    def start(self) -> None:
        """Start polling the watched references (no-op without any, or interval 0)."""
        interval = self.config.refresh_interval_seconds
        if self._task is None and self._watches and interval > 0:
            self._task = asyncio.get_running_loop().create_task(
                self._poll(interval), name="secret-refresh"
            )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def refresh(self) -> list[str]:
        """Re-read every watched reference once; call back those that changed. Returns
        the references that changed. A failure is logged (without the value) and the
        old value stays in use."""
        changed: list[str] = []
        for key, (ref, digest, callbacks) in list(self._watches.items()):
            try:
                value = await asyncio.to_thread(self._read, ref)
            except Exception as e:  # keep the old secret; try again next round
                log.warning("cannot refresh secret %s: %s", key, _describe(e))
                continue
            remember(value)
            new_digest = _digest(value)
            if digest == new_digest:
                continue
            self._watches[key] = (ref, new_digest, callbacks)
            if not digest:  # first read: the baseline, not a change
                continue
            changed.append(key)
            log.info("secret %s changed; applying the new value", key)
            for cb in callbacks:
                try:
                    res = cb(SecretStr(value))
                    if asyncio.iscoroutine(res):
                        await res
                except Exception:
                    log.exception("applying the new value of %s failed", key)
        return changed

    async def _poll(self, interval: float) -> None:
        await self.refresh()  # baseline
        while True:
            await asyncio.sleep(interval)
            await self.refresh()


def _digest(value: str) -> str:
    import hashlib

    return hashlib.sha256(value.encode()).hexdigest()


def _describe(e: BaseException) -> str:
    msg = getattr(e, "message", None)
    return str(msg) if msg else type(e).__name__


def _read_file(ref: SecretRef) -> str:
    path = ref.path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SecretError(
            f"secret file {path} (from {ref}) does not exist",
            details={"path": path},
            hint="Create it with mode 0600, owned by the service's user.",
        ) from None
    except OSError as e:
        raise SecretError(
            f"cannot read secret file {path}: {e.strerror}", details={"path": path}
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"secret file {path} is not a regular file", details={"path": path})
    if st.st_mode & 0o066:
        raise SecretError(
            f"secret file {path} is accessible by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o})",
            details={"path": path, "mode": f"{stat.S_IMODE(st.st_mode):04o}"},
            hint=f"Run `chmod 600 {path}` (readable by its owner only).",
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise SecretError(
            f"cannot read secret file {path}: {reason}", details={"path": path}
        ) from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise SecretError(f"secret file {path} is empty", details={"path": path})
    return text


# --- the config's secret fields -------------------------------------------------------


def resolve_config_secrets(cfg: Any, resolver: SecretResolver | None = None) -> dict[str, str]:
    """Replace every reference held by a secret field of ``cfg`` (a LatticeConfig) with
    its value, in place, and return ``{"section.field": reference}`` for what was
    resolved (kept on the config as ``cfg.secret_refs``, for :meth:`SecretResolver.watch`).
    ``accounting.waldur_token_secret_ref`` fills ``accounting.waldur_token`` when that is
    unset. The resolver is made from ``cfg.secrets`` when not given."""
    targets: list[tuple[str, Any, str, str]] = []
    for section_name in type(cfg).model_fields:
        section = getattr(cfg, section_name)
        for field_name in type(section).model_fields:
            value = getattr(section, field_name)
            if isinstance(value, SecretStr) and not is_reference(value):
                remember(value)  # a plain secret: masked in logs all the same
            if isinstance(value, SecretStr) and is_reference(value):
                targets.append(
                    (section_name, section, field_name, value.get_secret_value().strip())
                )
    acc = getattr(cfg, "accounting", None)
    if acc is not None and acc.waldur_token_secret_ref and acc.waldur_token is None:
        targets.append(("accounting", acc, "waldur_token", acc.waldur_token_secret_ref.strip()))
    refs: dict[str, str] = {}
    if not targets:
        return refs
    resolver = resolver or SecretResolver(cfg.secrets)
    for section_name, section, field_name, ref in targets:
        dotted = f"{section_name}.{field_name}"
        try:
            value = resolver.resolve(ref)
        except (SecretError, SecretUnavailable) as e:
            e.message = f"{dotted}: {e.message}"
            e.args = (e.message,)
            e.details = {"key": dotted, **e.details}
            raise
        setattr(section, field_name, value)
        refs[dotted] = ref
    return refs


__all__ = [
    "REFERENCED_ENV",
    "SCHEMES",
    "SECRET_ID_ENV",
    "SecretError",
    "SecretRef",
    "SecretResolver",
    "SecretUnavailable",
    "is_reference",
    "parse_ref",
    "redact",
    "remember",
    "resolve_config_secrets",
]
