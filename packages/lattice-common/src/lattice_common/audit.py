"""The tamper-evident audit log, as pure functions: entries, their canonical encoding,
the hash chain, Ed25519 signatures, the export format and its verification.

Every entry commits to the one before it: ``hash = chain_hash(prev_hash, body)`` where
``body`` is the entry's canonical encoding without ``hash`` and ``signature`` (it holds
``prev_hash`` and ``seq``), and ``signature`` is the Ed25519 signature of ``hash`` by the
key named ``key_id`` (the first 16 hex digits of the SHA-256 of the raw public key).
So an edited entry no longer matches its hash, a removed one leaves a gap in ``seq``
and a ``prev_hash`` that names nothing, and reordered ones break both; nobody without
the private key can write a new chain. Several keys may sign one chain (key rotation,
or members of a development cluster that each generated their own): every entry names
its key, and a verifier trusts a given set of public keys.

Canonical encoding: JSON, keys sorted, no whitespace (msgspec). The same bytes are the
lines of an export, so a verifier also checks that each line is exactly the canonical
encoding of what it decodes to: any byte changed is found, even one that decodes to
the same value.

Export (``export_lines``): JSON lines; the first is a header ``{"format":
"lattice-audit/1", "count", "first_seq", "last_hash", "exported_at", "public_keys":
{key_id: PEM}, "key_id", "signature"}`` signed by the exporting server (so a file that
lost its last entries is detected too), then one entry per line, oldest first.
:func:`verify_export` checks such a file with the public keys given (or, when none are
given, with those its header names: that proves the file is consistent, not who wrote
it) and names the first bad entry by its position in the chain: ``entry 17: hash does
not match its contents (edited?)``; ``entry 0`` is the header.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

GENESIS = "0" * 64  # prev_hash of the first entry
FORMAT = "lattice-audit/1"

# The actions the servers record (``action`` is free text; these are the ones in use).
NODE_CLAIM = "node.claim"
NODE_RELEASE = "node.release"
NODE_DRAIN = "node.drain"
NODE_UNDRAIN = "node.undrain"
NODE_DISABLE = "node.disable"
NODE_ENABLE = "node.enable"
TENANT_CREATE = "tenant.create"
TENANT_UPDATE = "tenant.update"
VCLUSTER_CREATE = "vcluster.create"
VCLUSTER_UPDATE = "vcluster.update"
ALLOCATION_SUBMIT = "allocation.submit"  # sensitive allocations
ALLOCATION_CANCEL = "allocation.cancel"  # sensitive allocations
ALLOCATION_END = "allocation.end"  # sensitive allocations
ALLOCATION_LOGS = "allocation.logs"  # sensitive allocations: logs read or followed
ALLOCATION_ATTACH = "allocation.attach"  # sensitive allocations: a terminal opened
AUTH_FAILED = "auth.failed"
CA_INIT = "ca.init"  # the internal CA created or rotated
CERT_ISSUE = "cert.issue"  # a certificate signed by the internal CA
NODE_IDENTITY_MISMATCH = "node.identity_mismatch"  # a certificate used for another node


class AuditEvent(msgspec.Struct, kw_only=True):
    """What happened, before it is placed in the chain and signed. ``id`` is the
    quorum's outbox number for events the state machine itself produced (0 otherwise)."""

    time: float
    actor: str
    action: str
    target: str = ""
    tenant: str = ""
    details: dict[str, str] = msgspec.field(default_factory=dict)
    id: int = 0


class AuditEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One entry of the chain. ``seq`` counts from 1 with no gaps."""

    seq: int
    time: float
    actor: str
    action: str
    target: str = ""
    tenant: str = ""
    details: dict[str, str] = msgspec.field(default_factory=dict)
    prev_hash: str = GENESIS
    key_id: str = ""
    hash: str = ""
    signature: str = ""


class ExportHeader(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: str
    count: int
    first_seq: int = 1
    last_hash: str = GENESIS
    exported_at: float = 0.0
    public_keys: dict[str, str] = msgspec.field(default_factory=dict)  # key_id -> PEM
    key_id: str = ""
    signature: str = ""


_canonical = msgspec.json.Encoder(order="sorted")
_entry_decoder = msgspec.json.Decoder(AuditEntry)
_header_decoder = msgspec.json.Decoder(ExportHeader)


def _builtins(obj: msgspec.Struct, *leave_out: str) -> dict[str, Any]:
    data = msgspec.to_builtins(obj)
    for k in leave_out:
        data.pop(k, None)
    return data


def canonical(obj: msgspec.Struct | Mapping[str, Any]) -> bytes:
    """JSON with sorted keys and no whitespace: the bytes hashed, signed and exported."""
    return _canonical.encode(obj if isinstance(obj, Mapping) else msgspec.to_builtins(obj))


def entry_body(entry: AuditEntry) -> bytes:
    """What ``hash`` covers: the entry without ``hash`` and ``signature``."""
    return canonical(_builtins(entry, "hash", "signature"))


def chain_hash(prev_hash: str, body: bytes) -> str:
    """SHA-256 (hex) of the previous entry's hash and this entry's body."""
    return hashlib.sha256(prev_hash.encode("ascii") + b"\n" + body).hexdigest()


# --------------------------------------------------------------------------- keys


def _ed25519() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519


def generate_private_key() -> Any:
    return _ed25519().Ed25519PrivateKey.generate()


def private_key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization as s

    return key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption())


def public_key_pem(key: Any) -> str:
    """The PEM (SubjectPublicKeyInfo) of a public key, or of a private key's public half."""
    from cryptography.hazmat.primitives import serialization as s

    if isinstance(key, _ed25519().Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo).decode()


def key_id(key: Any) -> str:
    """First 16 hex digits of the SHA-256 of the raw public key."""
    from cryptography.hazmat.primitives import serialization as s

    if isinstance(key, _ed25519().Ed25519PrivateKey):
        key = key.public_key()
    raw = key.public_bytes(s.Encoding.Raw, s.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


class AuditKeyError(ValueError):
    """A key file or PEM that is not an Ed25519 key."""


def load_private_key(data: bytes | str) -> Any:
    """The Ed25519 private key in PEM ``data``."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    raw = data.encode() if isinstance(data, str) else data
    try:
        key = load_pem_private_key(raw, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise AuditKeyError(f"not a PEM private key: {e}") from None
    if not isinstance(key, _ed25519().Ed25519PrivateKey):
        raise AuditKeyError("not an Ed25519 private key")
    return key


def load_public_key(data: bytes | str) -> Any:
    """The Ed25519 public key in PEM ``data`` (a private key PEM gives its public half)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    raw = data.encode() if isinstance(data, str) else data
    if b"PRIVATE KEY" in raw:
        return load_private_key(raw).public_key()
    try:
        key = load_pem_public_key(raw)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise AuditKeyError(f"not a PEM public key: {e}") from None
    if not isinstance(key, _ed25519().Ed25519PublicKey):
        raise AuditKeyError("not an Ed25519 public key")
    return key


def load_or_create_private_key(path: str | Path) -> tuple[Any, bool]:
    """The key in ``path``; a new one written there (mode 0600) when the file does not
    exist. Returns (key, created)."""
    import os

    p = Path(path)
    if p.exists():
        return load_private_key(p.read_bytes()), False
    key = generate_private_key()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_key_pem(key))
    os.replace(tmp, p)
    return key, True


def trusted_keys(keys: Iterable[Any]) -> dict[str, Any]:
    """key_id -> public key, from public keys, private keys or PEM texts."""
    out: dict[str, Any] = {}
    for k in keys:
        pub = load_public_key(k) if isinstance(k, str | bytes) else k
        if isinstance(pub, _ed25519().Ed25519PrivateKey):
            pub = pub.public_key()
        out[key_id(pub)] = pub
    return out


# --------------------------------------------------------------------------- signing


def _sign_hash(digest: str, private_key: Any) -> str:
    return base64.b64encode(private_key.sign(digest.encode("ascii"))).decode("ascii")


def _signature_ok(digest: str, signature: str, public_key: Any) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        raw = base64.b64decode(signature.encode("ascii"), validate=True)
        if base64.b64encode(raw).decode("ascii") != signature:  # unused bits set
            return False
        public_key.verify(raw, digest.encode("ascii"))
    except (InvalidSignature, ValueError, UnicodeEncodeError):
        return False
    return True


def sign(entry: AuditEntry, private_key: Any) -> AuditEntry:
    """``entry`` with ``key_id``, ``hash`` and ``signature`` set (a new record)."""
    out = msgspec.structs.replace(entry, key_id=key_id(private_key), hash="", signature="")
    out.hash = chain_hash(out.prev_hash, entry_body(out))
    out.signature = _sign_hash(out.hash, private_key)
    return out


def seal(
    events: Iterable[AuditEvent], private_key: Any, *, seq: int, prev_hash: str
) -> list[AuditEntry]:
    """``events`` as signed entries following the entry ``seq`` whose hash is
    ``prev_hash`` (``seq`` 0 and GENESIS for an empty log)."""
    out = []
    for ev in events:
        seq += 1
        e = sign(
            AuditEntry(
                seq=seq,
                time=ev.time,
                actor=ev.actor,
                action=ev.action,
                target=ev.target,
                tenant=ev.tenant,
                details=dict(ev.details),
                prev_hash=prev_hash,
            ),
            private_key,
        )
        prev_hash = e.hash
        out.append(e)
    return out


# --------------------------------------------------------------------------- verifying


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """``first_bad``: the position in the chain (its expected ``seq``) of the first bad
    entry, 0 for an export's header, None when everything verified."""

    ok: bool
    count: int  # entries that verified
    first_bad: int | None = None
    reason: str = ""
    last_hash: str = GENESIS
    key_ids: tuple[str, ...] = ()  # the keys that signed the verified entries

    @property
    def message(self) -> str:
        if self.ok:
            return f"{self.count} entries verified; last hash {self.last_hash}"
        where = "header" if self.first_bad == 0 else f"entry {self.first_bad}"
        return f"{where}: {self.reason}"


def check_entry(
    e: AuditEntry, pos: int, prev_hash: str, keys: Mapping[str, Any], later: set[int] | None = None
) -> str:
    """Why ``e`` cannot be entry ``pos`` after an entry whose hash is ``prev_hash``
    ("" when it can). ``later``: the seqs found after it (to tell removed from reordered)."""
    if e.seq != pos:
        if e.seq > pos and not (later and pos in later):
            return f"missing: the log goes on with entry {e.seq} (removed?)"
        return f"out of order: entry {e.seq} stands in its place (reordered?)"
    if e.prev_hash != prev_hash:
        return f"does not follow entry {pos - 1}: prev_hash does not match (removed, reordered or edited?)"
    if e.hash != chain_hash(e.prev_hash, entry_body(e)):
        return "hash does not match its contents (edited?)"
    key = keys.get(e.key_id)
    if key is None:
        return f"signed by an unknown key {e.key_id!r} (not one of the public keys given)"
    if not _signature_ok(e.hash, e.signature, key):
        return "signature does not verify (edited, or signed by another key?)"
    return ""


def verify_chain(
    entries: Sequence[AuditEntry],
    public_keys: Mapping[str, Any] | Iterable[Any],
    *,
    first_seq: int = 1,
    prev_hash: str = GENESIS,
) -> VerifyResult:
    """Check ``entries`` as the chain from ``first_seq`` (after ``prev_hash``) with the
    trusted ``public_keys`` (key_id -> key, or keys/PEMs)."""
    keys = public_keys if isinstance(public_keys, Mapping) else trusted_keys(public_keys)
    seqs = [e.seq for e in entries]
    used: dict[str, None] = {}
    for i, e in enumerate(entries):
        pos = first_seq + i
        why = check_entry(e, pos, prev_hash, keys, set(seqs[i + 1 :]))
        if why:
            return VerifyResult(False, i, pos, why, prev_hash, tuple(used))
        prev_hash = e.hash
        used[e.key_id] = None
    return VerifyResult(True, len(entries), None, "", prev_hash, tuple(used))


# --------------------------------------------------------------------------- export


def export_lines(
    entries: Sequence[AuditEntry],
    private_key: Any,
    public_keys: Mapping[str, str],
    *,
    exported_at: float,
) -> Iterable[bytes]:
    """The export: the signed header, then one canonical entry per line (each line ends
    with a newline). ``public_keys``: key_id -> PEM of every key that signed an entry."""
    keys = dict(public_keys)
    keys.setdefault(key_id(private_key), public_key_pem(private_key))
    header = ExportHeader(
        format=FORMAT,
        count=len(entries),
        first_seq=entries[0].seq if entries else 1,
        last_hash=entries[-1].hash if entries else GENESIS,
        exported_at=exported_at,
        public_keys=keys,
        key_id=key_id(private_key),
    )
    header.signature = _sign_hash(_header_digest(header), private_key)
    yield canonical(header) + b"\n"
    for e in entries:
        yield canonical(e) + b"\n"


def _header_digest(h: ExportHeader) -> str:
    return hashlib.sha256(canonical(_builtins(h, "signature"))).hexdigest()


def read_export(data: bytes) -> tuple[ExportHeader, list[AuditEntry]]:
    """Header and entries of an export (ValueError when it cannot be read at all);
    for checking one, use :func:`verify_export`."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if not lines:
        raise ValueError("empty file")
    header = _header_decoder.decode(lines[0])
    return header, [_entry_decoder.decode(ln) for ln in lines[1:]]


def verify_export(data: bytes, public_keys: Iterable[Any] | None = None) -> VerifyResult:
    """Check an export. With ``public_keys`` (keys or PEMs) only those are trusted; with
    None, the keys the header names are (the file's consistency, not its author)."""

    def bad(pos: int, why: str, count: int = 0, last: str = GENESIS) -> VerifyResult:
        return VerifyResult(False, count, pos, why, last)

    lines = data.split(b"\n")
    terminated = lines[-1] == b""
    if terminated:
        lines.pop()
    if not lines:
        return bad(0, "missing: the file is empty")
    try:
        header = _header_decoder.decode(lines[0])
    except (msgspec.DecodeError, ValueError) as e:  # not JSON, not UTF-8
        return bad(0, f"not a lattice audit export header ({e})")
    if header.format != FORMAT:
        return bad(0, f"unknown format {header.format!r} (expected {FORMAT})")
    if canonical(header) != lines[0] or (len(lines) == 1 and not terminated):
        return bad(0, "not in canonical form (edited?)")
    named: dict[str, Any] = {}
    for kid, pem in header.public_keys.items():
        try:
            named[kid] = load_public_key(pem)
        except ValueError as e:
            return bad(0, f"the public key {kid!r} it names cannot be read ({e})")
        if key_id(named[kid]) != kid:
            return bad(0, f"the key id {kid!r} does not match its public key (edited?)")
    keys = named if public_keys is None else trusted_keys(public_keys)
    hkey = keys.get(header.key_id)
    if hkey is None:
        return bad(
            0, f"signed by an unknown key {header.key_id!r} (not one of the public keys given)"
        )
    if not _signature_ok(_header_digest(header), header.signature, hkey):
        return bad(0, "signature does not verify (edited?)")

    raw = lines[1:]
    entries: list[AuditEntry | None] = []
    for ln in raw:
        try:
            entries.append(_entry_decoder.decode(ln))
        except (msgspec.DecodeError, ValueError):  # not JSON, not UTF-8
            entries.append(None)
    seqs = [e.seq if e is not None else -1 for e in entries]
    prev_hash = GENESIS if header.first_seq == 1 else None
    used: dict[str, None] = {}
    for i, e in enumerate(entries):
        pos = header.first_seq + i
        if e is None:
            return bad(pos, "not a valid entry (edited?)", i, prev_hash or GENESIS)
        if prev_hash is None:  # a partial export: trust the first entry's link
            prev_hash = e.prev_hash
        why = check_entry(e, pos, prev_hash, keys, set(seqs[i + 1 :]))
        if not why and canonical(e) != raw[i]:
            why = "not in canonical form (edited?)"
        if not why and i == len(entries) - 1 and not terminated:
            why = "does not end with a newline (edited?)"
        if why:
            return bad(pos, why, i, prev_hash)
        prev_hash = e.hash
        used[e.key_id] = None
    n = len(entries)
    last = prev_hash or GENESIS
    if n < header.count:
        pos = header.first_seq + n
        return bad(
            pos,
            f"missing: the file ends after {n} entries but its header lists {header.count} (removed?)",
            n,
            last,
        )
    if n > header.count:
        pos = header.first_seq + header.count
        return bad(
            pos, f"not listed in the header, which has {header.count} entries (added?)", n, last
        )
    if n and last != header.last_hash:
        return bad(
            header.first_seq + n - 1, "is not the last entry the header names (edited?)", n, last
        )
    return VerifyResult(True, n, None, "", last, tuple(used))


__all__ = [
    "ALLOCATION_ATTACH",
    "ALLOCATION_CANCEL",
    "ALLOCATION_END",
    "ALLOCATION_LOGS",
    "ALLOCATION_SUBMIT",
    "AUTH_FAILED",
    "CA_INIT",
    "CERT_ISSUE",
    "FORMAT",
    "GENESIS",
    "NODE_CLAIM",
    "NODE_DISABLE",
    "NODE_DRAIN",
    "NODE_ENABLE",
    "NODE_IDENTITY_MISMATCH",
    "NODE_RELEASE",
    "NODE_UNDRAIN",
    "TENANT_CREATE",
    "TENANT_UPDATE",
    "VCLUSTER_CREATE",
    "VCLUSTER_UPDATE",
    "AuditEntry",
    "AuditEvent",
    "AuditKeyError",
    "ExportHeader",
    "VerifyResult",
    "canonical",
    "chain_hash",
    "check_entry",
    "entry_body",
    "export_lines",
    "generate_private_key",
    "key_id",
    "load_or_create_private_key",
    "load_private_key",
    "load_public_key",
    "private_key_pem",
    "public_key_pem",
    "read_export",
    "seal",
    "sign",
    "trusted_keys",
    "verify_chain",
    "verify_export",
]
