"""uenv registries, shared by the node agent (which fetches images) and the API (which
resolves ``spec.uenv`` at submit).

* **Refs** ``name/version[:tag]`` (:func:`parse_ref`, :func:`format_ref`): anything else
  raises :class:`UenvNotFound`, never another exception.
* **The index** (``index.json``): ``{"name/version:tag": {"file": <path relative to the
  registry>, "sha256": <hex>, "size": <bytes>, "signature": <base64>}}``.
  :func:`parse_index` reads it, :func:`match_ref` finds a ref's entry: an exact key, or
  for a ref without tag the only tagged entry of that name/version; an unknown ref is
  refused naming the available versions (or names).
* **Registries** (:class:`UenvRegistry`): a directory, or an ``http://``/``https://``
  URL (``GET <url>/index.json``, images at ``<url>/<file>``, read with the stdlib and a
  timeout; an unreachable one raises :class:`UenvUnreachable`).
* **Signatures**: with a site key (an Ed25519 public key in PEM), every entry must carry
  ``signature`` = base64 Ed25519 signature over the ASCII sha256 hex of the image; the
  hash itself is checked when the image is copied, so a signed hash pins the content.
  :func:`sign_index_entry` makes one (operators, tests).
* **Views** (``meta/env.json`` in the image): :func:`parse_views`, :func:`find_view`,
  :func:`apply_view` (literal values, or ``prepend``/``append`` lists joined with ``:``
  onto the existing value).
* :class:`CachedIndex`: the API's resolver, the index kept for a short TTL and read in a
  thread so a slow HTTP registry never blocks the event loop.

``cryptography`` is imported only where signatures are made or checked.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

__all__ = [
    "CachedIndex",
    "IndexEntry",
    "UenvChanged",
    "UenvDisabled",
    "UenvError",
    "UenvHashMismatch",
    "UenvImage",
    "UenvNotFound",
    "UenvRegistry",
    "UenvSignatureError",
    "UenvUnreachable",
    "UenvView",
    "apply_view",
    "check_view_name",
    "find_view",
    "format_ref",
    "load_public_key",
    "match_ref",
    "parse_index",
    "parse_ref",
    "parse_views",
    "sign_index_entry",
    "verify_signature",
]

MAX_REF_LENGTH = 256
MAX_INDEX_BYTES = 64 << 20  # an index is a small JSON file; refuse to buffer anything huge
DEFAULT_TIMEOUT = 30.0  # seconds per connect / read of an HTTP registry
_PART = r"[A-Za-z0-9][A-Za-z0-9._+-]*"
_REF = re.compile(rf"({_PART})/({_PART})(?::([A-Za-z0-9._+-]+))?")
_VIEW = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
REF_HINT = "A uenv is given as NAME/VERSION[:TAG], e.g. --uenv=prgenv-gnu/24.11:v1."


class UenvError(Exception):
    """A uenv could not be resolved, fetched, verified or mounted; ``message`` is the
    user-facing cause and ``hint`` what to do about it."""

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UenvDisabled(UenvError):
    """No registry is configured."""


class UenvNotFound(UenvError):
    """A ref that is malformed or not in the registry; ``available`` lists what is."""

    def __init__(self, message: str, *, hint: str = "", available: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint=hint)
        self.available = available


class UenvHashMismatch(UenvError):
    """The image's content does not hash to the index's sha256."""


class UenvSignatureError(UenvError):
    """The site requires signed images and this entry's signature is missing or wrong."""


class UenvUnreachable(UenvError):
    """The registry could not be reached (network, HTTP 5xx, timeout)."""


class UenvChanged(UenvError):
    """The registry now names a different image for a ref than at submit."""


# --------------------------------------------------------------------------- refs


def parse_ref(ref: str) -> tuple[str, str, str]:
    """``name/version[:tag]`` -> (name, version, tag or ""); raises only UenvNotFound."""
    text = ref.strip() if isinstance(ref, str) else ""
    m = _REF.fullmatch(text) if len(text) <= MAX_REF_LENGTH else None
    if m is None:
        shown = ref if isinstance(ref, str) and len(ref) <= 80 else f"{str(ref)[:77]}..."
        raise UenvNotFound(f"uenv {shown!r}: not of the form name/version[:tag]", hint=REF_HINT)
    return m.group(1), m.group(2), m.group(3) or ""


def format_ref(name: str, version: str, tag: str = "") -> str:
    return f"{name}/{version}" + (f":{tag}" if tag else "")


def check_view_name(view: str) -> str:
    """A view name (one word: letters, digits, ``._+-``); raises UenvError otherwise."""
    if not isinstance(view, str) or not _VIEW.fullmatch(view):
        raise UenvError(
            f"invalid uenv view {str(view)[:80]!r}",
            hint="A view is one word naming a view of the uenv, e.g. --view=default.",
        )
    return view


# --------------------------------------------------------------------------- the index


@dataclass(frozen=True)
class IndexEntry:
    """One index entry, checked: its key, the file (relative to the registry), what the
    content must hash to, its size (-1 unknown) and its signature ("" none)."""

    key: str
    file: str
    sha256: str
    size: int = -1
    signature: str = ""


def parse_index(raw: bytes | str, source: str) -> dict[str, dict[str, Any]]:
    """The entries of an ``index.json`` (entries that are not objects are left out: they
    can never match). ``source`` names the registry in errors."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise UenvError(
            f"uenv registry {source}: unreadable index.json: {e}",
            hint="The registry's index.json must be a JSON object of name/version:tag entries.",
        ) from None
    if not isinstance(data, dict):
        raise UenvError(
            f"uenv registry {source}: index.json is not an object",
            hint="The registry's index.json must be a JSON object of name/version:tag entries.",
        )
    return {str(k): v for k, v in data.items() if isinstance(v, dict)}


def match_ref(index: Mapping[str, Mapping[str, Any]], ref: str) -> IndexEntry:
    """The entry for ``ref``: an exact key, or for a ref without tag the only tagged
    entry of that name/version. Otherwise UenvNotFound naming what exists."""
    name, version, tag = parse_ref(ref)
    key = format_ref(name, version, tag)
    entry = index.get(key)
    if entry is None and not tag:
        tagged = sorted(k for k in index if k.startswith(f"{key}:"))
        if len(tagged) == 1:
            key = tagged[0]
            entry = index[key]
        elif tagged:
            raise UenvNotFound(
                f"uenv {ref}: more than one tag in the registry: {', '.join(tagged)}",
                hint="Name the tag, e.g. --uenv=" + tagged[-1] + ".",
                available=tuple(tagged),
            )
    if entry is None:
        same = tuple(sorted(k for k in index if k.split("/", 1)[0] == name))
        if same:
            raise UenvNotFound(
                f"uenv {ref}: not in the registry; available: {', '.join(same)}",
                hint=f"Pick one of the available versions of {name}: {', '.join(same)}.",
                available=same,
            )
        names = tuple(sorted({k.split("/", 1)[0] for k in index}))
        raise UenvNotFound(
            f"uenv {ref}: no uenv named {name!r} in the registry; "
            f"available: {', '.join(names) or 'none'}",
            hint=(
                f"Pick one of the uenvs this site offers: {', '.join(names)}."
                if names
                else "This site's registry has no uenv yet; submit without --uenv."
            ),
            available=names,
        )
    return _entry(key, ref, entry)


def _entry(key: str, ref: str, entry: Mapping[str, Any]) -> IndexEntry:
    bad = f"uenv {ref}: bad registry entry {key!r}"
    hint = 'An entry is {"file": ..., "sha256": ..., "size": ..., "signature": ...}.'
    file, sha, size, sig = (
        entry.get("file"),
        entry.get("sha256"),
        entry.get("size", -1),
        entry.get("signature", ""),
    )
    if not isinstance(file, str) or not file:
        raise UenvError(f"{bad}: no file", hint=hint)
    path = PurePosixPath(file)
    # the file is relative to the registry: an entry may not name a file outside it
    if path.is_absolute() or ".." in path.parts or "\\" in file or "\0" in file:
        raise UenvError(f"{bad}: file {file!r} is not inside the registry", hint=hint)
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha.lower()):
        raise UenvError(f"{bad}: sha256 is not 64 hex digits", hint=hint)
    if isinstance(size, bool) or not isinstance(size, int):
        raise UenvError(f"{bad}: size is not a whole number", hint=hint)
    if not isinstance(sig, str):
        raise UenvError(f"{bad}: signature is not text", hint=hint)
    return IndexEntry(key=key, file=file, sha256=sha.lower(), size=size, signature=sig)


# --------------------------------------------------------------------------- signatures

_SIGN_HINT = (
    "This site runs only signed uenv images (node_agent.uenv_signing_key): sign the "
    "image's sha256 with the site key (lattice_common.uenv_registry.sign_index_entry) and "
    'add it to the index entry as "signature".'
)


def load_public_key(path: str | Path) -> Any:
    """The Ed25519 public key in the PEM file ``path``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    hint = "node_agent.uenv_signing_key names a PEM file with the site's Ed25519 public key."
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UenvError(
            f"uenv signing key {path}: cannot read: {e.strerror or e}", hint=hint
        ) from None
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise UenvError(f"uenv signing key {path}: not a PEM public key: {e}", hint=hint) from None
    if not isinstance(key, Ed25519PublicKey):
        raise UenvError(f"uenv signing key {path}: not an Ed25519 key", hint=hint)
    return key


def sign_index_entry(private_key_pem: bytes | str, sha256_hex: str) -> str:
    """The ``signature`` of an index entry: base64 Ed25519 signature over the ASCII sha256
    hex (lower case) of the image, with the site's private key (PEM, unencrypted)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    pem = private_key_pem.encode() if isinstance(private_key_pem, str) else private_key_pem
    key = load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise UenvError("uenv signing: the private key is not an Ed25519 key")
    sha = sha256_hex.strip().lower()
    if not _SHA256.fullmatch(sha):
        raise UenvError(f"uenv signing: {sha256_hex!r} is not a sha256 hex digest")
    return base64.b64encode(key.sign(sha.encode("ascii"))).decode("ascii")


def verify_signature(entry: IndexEntry, public_key: Any, ref: str = "") -> None:
    """Refuse ``entry`` unless it carries a signature of its sha256 by ``public_key``."""
    from cryptography.exceptions import InvalidSignature

    what = ref or entry.key
    if not entry.signature:
        raise UenvSignatureError(f"uenv {what}: signature missing", hint=_SIGN_HINT)
    try:
        sig = base64.b64decode(entry.signature, validate=True)
        public_key.verify(sig, entry.sha256.encode("ascii"))
    except (binascii.Error, ValueError, InvalidSignature):
        raise UenvSignatureError(
            f"uenv {what}: signature does not verify with the site key", hint=_SIGN_HINT
        ) from None


# --------------------------------------------------------------------------- registries


@dataclass(frozen=True)
class UenvImage:
    """A resolved ref: the index key it matched, where the image is (a path or a URL),
    what it must hash to and its size (-1 unknown)."""

    ref: str
    location: str
    sha256: str
    size: int
    signature: str = ""


def is_http(location: str) -> bool:
    return location.startswith(("http://", "https://"))


class UenvRegistry:
    """A directory (``<root>/index.json``) or an HTTP registry (``<url>/index.json``).
    The index is read on every :meth:`resolve` (images can be published while the agent
    runs); :class:`CachedIndex` is the API's cached form. ``signing_key``: a PEM path or a
    loaded Ed25519 public key; with one, unsigned entries are refused."""

    def __init__(
        self,
        location: str | Path,
        *,
        signing_key: str | Path | Any | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        text = str(location)
        self.http = is_http(text)
        self.location = text.rstrip("/") if self.http else text
        self.root = Path(text) if not self.http else None
        self.timeout = timeout
        if isinstance(signing_key, str | Path):
            signing_key = load_public_key(signing_key) if str(signing_key) else None
        self.signing_key = signing_key

    def __repr__(self) -> str:
        return f"UenvRegistry({self.location!r}, signed={self.signing_key is not None})"

    # ---- reading

    def read_index(self) -> bytes:
        if self.root is not None:
            path = self.root / "index.json"
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_INDEX_BYTES + 1)
            except FileNotFoundError:
                raise UenvError(
                    f"uenv registry {self.root}: no index.json",
                    hint="node_agent.uenv_registry names a directory with an index.json.",
                ) from None
            except OSError as e:
                raise UenvError(
                    f"uenv registry {self.root}: unreadable index.json: {e.strerror or e}"
                ) from None
        else:
            try:
                with self._get("index.json", what="index.json") as resp:
                    data = resp.read(MAX_INDEX_BYTES + 1)
            except (OSError, http.client.HTTPException) as e:  # cut off mid-body, timeouts
                raise UenvUnreachable(
                    f"uenv registry {self.location} unreachable: {e or type(e).__name__}",
                    hint="Check the registry server; the request can be retried.",
                ) from None
        if len(data) > MAX_INDEX_BYTES:
            raise UenvError(f"uenv registry {self.location}: index.json is too large")
        return data

    def index(self) -> dict[str, dict[str, Any]]:
        return parse_index(self.read_index(), self.location)

    def image(self, entry: IndexEntry) -> UenvImage:
        """``entry`` made a :class:`UenvImage`, its signature checked if the site wants it."""
        if self.signing_key is not None:
            verify_signature(entry, self.signing_key)
        if self.root is not None:
            location = str(self.root / entry.file)
        else:
            location = f"{self.location}/{urllib.parse.quote(entry.file)}"
        return UenvImage(
            ref=entry.key,
            location=location,
            sha256=entry.sha256,
            size=entry.size,
            signature=entry.signature,
        )

    def resolve(self, ref: str) -> UenvImage:
        return self.image(match_ref(self.index(), ref))

    @contextmanager
    def open_image(self, image: UenvImage) -> Iterator[IO[bytes]]:
        """The image's bytes as a stream (a local file, or the HTTP response)."""
        if self.root is None:
            rel = image.location[len(self.location) + 1 :]
            with self._get(rel, what="image", ref=image.ref) as resp:
                yield resp
            return
        try:
            f = open(image.location, "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise UenvError(
                f"uenv {image.ref}: image file {image.location} missing",
                hint="The registry's index names a file that is not there.",
            ) from None
        except OSError as e:
            raise UenvError(
                f"uenv {image.ref}: could not read {image.location}: {e.strerror or e}"
            ) from None
        with f:
            yield f

    @contextmanager
    def _get(self, rel: str, *, what: str, ref: str = "") -> Iterator[IO[bytes]]:
        url = f"{self.location}/{rel}"
        request = urllib.request.Request(url, headers={"User-Agent": "lattice-uenv"})
        try:
            resp = urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 404 and ref:
                raise UenvError(
                    f"uenv {ref}: image file {url} missing (HTTP 404)",
                    hint="The registry's index names a file that is not there.",
                ) from None
            if e.code == 404:
                raise UenvError(
                    f"uenv registry {self.location}: no {what} (HTTP 404 for {url})",
                    hint="node_agent.uenv_registry names a URL that serves index.json.",
                ) from None
            raise UenvUnreachable(
                f"uenv registry {self.location} unreachable: HTTP {e.code} {e.reason} for {url}",
                hint="Check the registry server; the request can be retried.",
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise UenvUnreachable(
                f"uenv registry {self.location} unreachable: {reason}",
                hint=f"Check that {url} can be reached from this host (node_agent.uenv_registry).",
            ) from None
        with resp:
            yield resp


# --------------------------------------------------------------------------- the API's cache


@dataclass
class CachedIndex:
    """A registry's index kept for ``ttl`` seconds (a failure for ``failure_ttl``), read
    in a thread: the API resolves refs at submit without blocking its event loop, and a
    burst of submissions costs one read."""

    registry: UenvRegistry
    ttl: float = 30.0
    failure_ttl: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _index: dict[str, dict[str, Any]] | None = field(default=None, init=False)
    _read_at: float = field(default=float("-inf"), init=False)
    _error: UenvError | None = field(default=None, init=False)
    _lock: asyncio.Lock | None = field(default=None, init=False)

    async def index(self) -> dict[str, dict[str, Any]]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent submits share one read
            age = self.clock() - self._read_at
            if self._error is not None and age < self.failure_ttl:
                raise self._error
            if self._index is not None and self._error is None and age < self.ttl:
                return self._index
            try:
                self._index = await asyncio.to_thread(self.registry.index)
                self._error = None
            except UenvError as e:
                self._index, self._error = None, e
                raise
            finally:
                self._read_at = self.clock()
            return self._index

    async def resolve(self, ref: str) -> UenvImage:
        parse_ref(ref)  # a malformed ref is refused without reading the registry
        return self.registry.image(match_ref(await self.index(), ref))


# --------------------------------------------------------------------------- views


@dataclass(frozen=True)
class UenvView:
    """One view of ``meta/env.json``: each variable set to a literal, or a list of paths
    put before (``prepend``) and/or after (``append``) its existing value."""

    name: str
    description: str = ""
    values: Mapping[str, str] = field(default_factory=dict)
    prepend: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    append: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def _text(v: Any, where: str, ref: str) -> str:
    if not isinstance(v, str) or "\0" in v:
        raise UenvError(f"uenv {ref}: bad meta/env.json: {where} is not text")
    return v


def parse_views(raw: bytes | str, ref: str) -> dict[str, UenvView]:
    """``{"views": {NAME: {"description": ..., "env": {VAR: value | {"prepend": [...]} |
    {"append": [...]}}}}}`` -> the views by name."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise UenvError(f"uenv {ref}: bad meta/env.json: {e}") from None
    views = data.get("views", {}) if isinstance(data, dict) else None
    if not isinstance(views, dict):
        raise UenvError(f"uenv {ref}: bad meta/env.json: no views object")
    out: dict[str, UenvView] = {}
    for name, body in views.items():
        if not isinstance(body, dict):
            raise UenvError(f"uenv {ref}: bad meta/env.json: view {name!r} is not an object")
        env = body.get("env", {})
        if not isinstance(env, dict):
            raise UenvError(f"uenv {ref}: bad meta/env.json: env of view {name!r}")
        sets: dict[str, str] = {}
        pre: dict[str, tuple[str, ...]] = {}
        post: dict[str, tuple[str, ...]] = {}
        for var, value in env.items():
            where = f"view {name!r} variable {var!r}"
            if not _ENV_NAME.fullmatch(var):
                raise UenvError(f"uenv {ref}: bad meta/env.json: {where}: not a variable name")
            if isinstance(value, dict) and value and set(value) <= {"prepend", "append"}:
                for op, into in (("prepend", pre), ("append", post)):
                    items = value.get(op, [])
                    if not isinstance(items, list):
                        raise UenvError(
                            f"uenv {ref}: bad meta/env.json: {where}: {op} is not a list"
                        )
                    into[var] = tuple(_text(i, where, ref) for i in items)
            else:
                sets[var] = _text(value, where, ref)
        out[str(name)] = UenvView(
            name=str(name),
            description=str(body.get("description") or ""),
            values=sets,
            prepend={k: v for k, v in pre.items() if v},
            append={k: v for k, v in post.items() if v},
        )
    return out


def find_view(views: Mapping[str, UenvView], ref: str, name: str) -> UenvView:
    view = views.get(name)
    if view is None:
        names = ", ".join(sorted(views)) or "none"
        raise UenvError(
            f"uenv {ref} has no view {name} (views: {names})",
            hint=f"Pick one of the views of {ref} with --view: {names}."
            if views
            else f"{ref} has no views; submit without --view.",
        )
    return view


def apply_view(env: dict[str, str], view: UenvView) -> dict[str, str]:
    """Apply ``view`` to ``env`` (in place; returned): literals replace, lists are joined
    with ``:`` before / after the existing value (an empty one is left out)."""
    for var, value in view.values.items():
        env[var] = value
    for var in {*view.prepend, *view.append}:
        parts = [*view.prepend.get(var, ()), env.get(var, ""), *view.append.get(var, ())]
        env[var] = ":".join(p for p in parts if p)
    return env
