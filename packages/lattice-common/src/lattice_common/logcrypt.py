"""Encryption at rest of the sensitive log pool (spec: Sensitive Workloads, Observability
Constraints: "Logs from sensitive allocations are encrypted at rest in the dedicated
sensitive S3 pool").

Why this module exists: the sensitive pool may be a plain directory or an S3 bucket whose
server does not encrypt (or whose operators must not read it), so the objects are
encrypted by Lattice itself, before they leave the process, the same way on every
backend. :class:`EncryptedLogStore` wraps any :class:`~lattice_common.logstore.LogStore`:
every object it writes is sealed, every object it reads is opened; keys and listings are
unchanged (they hold tenant, project, allocation and node names, never output).

An object is::

    b"LLE1" | key id length (1 byte) | key id (ASCII) | nonce (12 bytes) | AES-256-GCM ciphertext + tag

AES-256-GCM with a fresh random nonce per object; the authenticated data is the header
(magic, key id, nonce) and the object's key, so an altered byte, a truncated object, or
an object copied under another key fails to open. The key id is the first 8 bytes of
SHA-256 over the key (hex): a reader with the wrong key says so instead of reporting
corruption. The key is 32 bytes written as base64 or 64 hex digits
(``storage.sensitive_log_key``, a secret reference such as ``vault://lattice/log-key``).
A wrapper can be given earlier keys as well, to read what they sealed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lattice_common.errors import ValidationError
from lattice_common.logstore import FsLogStore, LogStore, LogStoreError, S3LogStore

if TYPE_CHECKING:
    from lattice_common.config import StorageConfig

__all__ = [
    "MAGIC",
    "EncryptedLogStore",
    "LogKey",
    "LogKeyError",
    "open_sealed",
    "open_sensitive_log_store",
    "parse_key",
    "seal",
]

MAGIC = b"LLE1"
_NONCE = 12
KEY_BYTES = 32


class LogKeyError(LogStoreError):
    """An object could not be opened: a wrong key, or it was altered."""


class LogKey:
    """A 32-byte AES-256 key and its id (never printed: ``repr`` shows the id only)."""

    __slots__ = ("_aead", "id")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a log key is {KEY_BYTES} bytes, not {len(key)}")
        self.id = hashlib.sha256(key).hexdigest()[:16]
        self._aead = AESGCM(key)

    def __repr__(self) -> str:
        return f"LogKey(id={self.id})"


def parse_key(text: str) -> LogKey:
    """A key written as 64 hex digits or base64 (standard or URL-safe) of 32 bytes;
    ValueError (naming no part of the value) when it is neither."""
    s = text.strip()
    raw: bytes | None = None
    if len(s) == 2 * KEY_BYTES:
        try:
            raw = bytes.fromhex(s)
        except ValueError:
            raw = None
    if raw is None:
        try:
            raw = base64.b64decode(s.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raw = None
    if raw is None or len(raw) != KEY_BYTES:
        raise ValueError(
            f"storage.sensitive_log_key must be {KEY_BYTES} random bytes as 64 hex digits "
            "or base64 (e.g. `openssl rand -base64 32`)"
        )
    return LogKey(raw)


def _header(key_id: str, nonce: bytes) -> bytes:
    kid = key_id.encode("ascii")
    return MAGIC + bytes([len(kid)]) + kid + nonce


def seal(key: LogKey, plaintext: bytes, name: str, *, nonce: bytes | None = None) -> bytes:
    """``plaintext`` as one sealed object stored under ``name``."""
    nonce = os.urandom(_NONCE) if nonce is None else nonce
    header = _header(key.id, nonce)
    return header + key._aead.encrypt(nonce, plaintext, header + name.encode("utf-8"))


def open_sealed(keys: Iterable[LogKey], data: bytes, name: str) -> bytes:
    """The plaintext of a sealed object stored under ``name``; :class:`LogKeyError` when
    it is not sealed, sealed with a key not in ``keys``, or altered."""
    if len(data) < len(MAGIC) + 1 or not data.startswith(MAGIC):
        raise LogKeyError(f"{name}: not an encrypted log object (no {MAGIC.decode()} header)")
    n = data[len(MAGIC)]
    start = len(MAGIC) + 1
    kid_raw, nonce = data[start : start + n], data[start + n : start + n + _NONCE]
    body = data[start + n + _NONCE :]
    if len(nonce) != _NONCE or len(body) < 16:
        raise LogKeyError(f"{name}: encrypted log object is truncated")
    kid = kid_raw.decode("ascii", "replace")
    by_id = {k.id: k for k in keys}
    key = by_id.get(kid)
    if key is None:
        raise LogKeyError(
            f"{name}: encrypted with key id {kid}, but this process has key id(s) "
            f"{', '.join(sorted(by_id)) or 'none'} (storage.sensitive_log_key)"
        )
    header = data[: start + n + _NONCE]
    try:
        return key._aead.decrypt(nonce, body, header + name.encode("utf-8"))
    except InvalidTag:
        raise LogKeyError(
            f"{name}: encrypted log object failed authentication (altered or damaged)"
        ) from None


class EncryptedLogStore:
    """A :class:`~lattice_common.logstore.LogStore` whose objects are sealed with ``key``
    in ``inner`` (module docstring); ``old_keys`` are still accepted when reading."""

    def __init__(self, inner: LogStore, key: LogKey, old_keys: Iterable[LogKey] = ()) -> None:
        self.inner = inner
        self.key = key
        self._keys = [key, *old_keys]
        self.name = f"{inner.name} (encrypted, key id {key.id})"

    def _open(self, key: str, data: bytes) -> bytes:
        try:
            return open_sealed(self._keys, data, key)
        except LogKeyError as e:
            raise LogKeyError(f"log store {self.inner.name}: {e}") from None

    async def put(self, key: str, data: bytes) -> None:
        await self.inner.put(key, seal(self.key, data, key))

    async def get(self, key: str) -> bytes | None:
        data = await self.inner.get(key)
        return None if data is None else self._open(key, data)

    async def list(self, prefix: str) -> list[str]:
        return await self.inner.list(prefix)

    async def update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        def sealed(old: bytes | None) -> bytes:
            plain = None if old is None else self._open(key, old)
            return seal(self.key, change(plain), key)

        await self.inner.update(key, sealed)

    async def delete(self, prefix: str) -> int:
        return await self.inner.delete(prefix)

    async def close(self) -> None:
        await self.inner.close()


def open_sensitive_log_store(storage: StorageConfig) -> LogStore | None:
    """The sensitive pool ``storage`` configures, every object encrypted with
    ``storage.sensitive_log_key`` (lattice_common.logcrypt); None: ``sensitive_log_store:
    none`` (sensitive output then stays on its nodes). ValidationError when the pool is
    set but the key is missing or malformed: a process with a pool it cannot encrypt for
    does not start."""

    kind = storage.sensitive_log_store
    if kind == "none":
        return None
    secret = storage.sensitive_log_key
    hint = (
        "Set storage.sensitive_log_key to a reference to 32 random bytes "
        "(e.g. `openssl rand -base64 32` stored in Vault), or sensitive_log_store: none."
    )
    if secret is None or not secret.get_secret_value().strip():
        raise ValidationError(
            "storage.sensitive_log_store is set but storage.sensitive_log_key is not", hint=hint
        )
    try:
        key = parse_key(secret.get_secret_value())
    except ValueError as e:
        raise ValidationError(str(e), hint=hint) from None
    inner: LogStore
    if kind == "s3":
        key_id = storage.s3_access_key_id
        s3_secret = storage.s3_secret_access_key
        inner = S3LogStore(
            bucket=storage.sensitive_log_bucket,
            endpoint_url=storage.s3_endpoint,
            region=storage.s3_region,
            access_key_id=key_id.get_secret_value() if key_id else None,
            secret_access_key=s3_secret.get_secret_value() if s3_secret else None,
            server_side_encryption=True,
        )
    else:
        inner = FsLogStore(storage.sensitive_log_store_dir)
    return EncryptedLogStore(inner, key)
