"""The backup file: a self-describing container for one snapshot of the quorum state.

Pure functions on bytes, shared by the server (lattice_quorum.backup, lattice_api.ops.backup)
and the CLI (``lattice admin backup verify ./file`` checks a local file itself, without a
server), which is why it lives here and not in lattice-quorum.

Layout (all of it covered by the trailing checksum, so any changed byte is detected)::

    b"LATTICE BACKUP\\n"          magic, 15 bytes
    uint32 big-endian             length H of the header
    H bytes                       header: UTF-8 JSON (BackupHeader)
    header.payload.size bytes     the payload: the msgpack-encoded GlobalState, gzip'd
    32 bytes                      sha256 of everything above (the file checksum)

The header says what the file holds without decoding the payload: format version,
Lattice version, site, when, the Raft term/index/membership and the state revision it was
taken at, the record counts, and the payload's own size and sha256.

Reading checks, in order: the magic (not a backup), the header (truncated or damaged),
the format version (newer than this Lattice: refused before anything else is trusted),
the file checksum, the payload size and checksum, then decompression and decoding of
the state (lattice_quorum.backup decodes into the full GlobalState; :class:`StateView`
here decodes the records people count, for the CLI).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from lattice_common.audit import AuditEntry
from lattice_common.errors import ValidationError
from lattice_common.types import Allocation, Node, Tenant, VCluster

MAGIC = b"LATTICE BACKUP\n"
#: the container format this Lattice writes and the newest it reads
FORMAT_VERSION = 1
PAYLOAD_ENCODING = "msgpack+gzip"
S = TypeVar("S")
_LEN = struct.Struct(">I")
_DIGEST = 32
_MAX_HEADER = 1 << 20  # a header is a few hundred bytes; more is damage


class RaftPosition(msgspec.Struct, kw_only=True):
    """Where in the Raft log the snapshot was taken."""

    term: int = 0
    index: int = 0  # last applied log index
    members: list[dict[str, Any]] = msgspec.field(default_factory=list)  # {id, address}


class PayloadInfo(msgspec.Struct, kw_only=True):
    encoding: str = PAYLOAD_ENCODING
    size: int = 0  # compressed bytes in the file
    sha256: str = ""  # of those bytes, hex


class BackupHeader(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    lattice_version: str = ""
    site: str = ""
    created_at: float = 0.0
    revision: int = 0  # GlobalState.revision captured
    raft: RaftPosition = msgspec.field(default_factory=RaftPosition)
    counts: dict[str, int] = msgspec.field(default_factory=dict)
    payload: PayloadInfo = msgspec.field(default_factory=PayloadInfo)


class StateView(msgspec.Struct, kw_only=True):
    """The records of a GlobalState payload that people count, typed (the other fields
    are skipped): decoding into it is the CLI's deserialisation check."""

    revision: int = 0
    nodes: dict[str, Node] = msgspec.field(default_factory=dict)
    allocations: dict[str, Allocation] = msgspec.field(default_factory=dict)
    tenants: dict[str, Tenant] = msgspec.field(default_factory=dict)
    vclusters: dict[str, VCluster] = msgspec.field(default_factory=dict)
    audit_log: list[AuditEntry] = msgspec.field(default_factory=list)


class BackupError(ValidationError):
    """The file is not a usable backup (damaged, truncated, newer, inconsistent)."""


_CORRUPT_HINT = (
    "The file was damaged or changed after it was written (or is incomplete); use "
    "another backup, e.g. an older snap-*.bin, and check the copy or upload that made it."
)


def counts_of(state: Any) -> dict[str, int]:
    """The record counts a header carries (any object with GlobalState's fields)."""
    return {
        "allocations": len(state.allocations),
        "nodes": len(state.nodes),
        "tenants": len(state.tenants),
        "vclusters": len(state.vclusters),
        "audit_entries": len(state.audit_log),
    }


def pack(header: BackupHeader, state_msgpack: bytes, *, level: int = 6) -> bytes:
    """The whole file for ``state_msgpack`` (the encoded GlobalState); the header's
    payload fields are filled here."""
    payload = gzip.compress(state_msgpack, compresslevel=level, mtime=0)
    header = msgspec.structs.replace(
        header,
        payload=PayloadInfo(size=len(payload), sha256=hashlib.sha256(payload).hexdigest()),
    )
    head = json.dumps(msgspec.to_builtins(header), sort_keys=True).encode()
    body = b"".join([MAGIC, _LEN.pack(len(head)), head, payload])
    return body + hashlib.sha256(body).digest()


def read_header(data: bytes) -> tuple[BackupHeader, int]:
    """The header and the offset of the payload. Checks the magic, the header's shape
    and the format version only: the checksum is :func:`unpack`'s."""
    if not data.startswith(MAGIC):
        raise BackupError(
            "not a Lattice backup file (no LATTICE BACKUP header)",
            hint="Give a file written by `lattice admin backup create` or a scheduled "
            "snapshot (snap-*.bin); if it is one, it is damaged at its start.",
        )
    start = len(MAGIC) + _LEN.size
    if len(data) < start:
        raise BackupError("backup file is truncated (header incomplete)", hint=_CORRUPT_HINT)
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    if hlen > _MAX_HEADER or len(data) < start + hlen:
        raise BackupError("backup file is truncated or corrupted (header)", hint=_CORRUPT_HINT)
    raw = data[start : start + hlen]
    try:
        fields = json.loads(raw)
        version = fields.get("format_version") if isinstance(fields, dict) else None
    except (ValueError, UnicodeDecodeError):
        version = None
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise BackupError(
            f"backup format version {version} is newer than this Lattice supports "
            f"({FORMAT_VERSION})",
            details={"lattice_version": str(fields.get("lattice_version", ""))},
            hint="Verify and restore it with the Lattice release that wrote it (or a newer "
            "one); this release cannot read it.",
        )
    try:
        header = msgspec.json.decode(raw, type=BackupHeader)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise BackupError(
            f"backup file is corrupted: unreadable header ({e})", hint=_CORRUPT_HINT
        ) from None
    if header.format_version < 1:
        raise BackupError(
            f"backup file is corrupted: format version {header.format_version}",
            hint=_CORRUPT_HINT,
        )
    return header, start + hlen


def unpack(data: bytes) -> tuple[BackupHeader, bytes]:
    """Check everything but the state's meaning; return the header and the encoded
    state (msgpack). Raises :class:`BackupError` with what is wrong."""
    header, off = read_header(data)
    end = off + header.payload.size
    if len(data) != end + _DIGEST:
        raise BackupError(
            f"backup file is truncated or corrupted: {len(data)} bytes, the header "
            f"describes {end + _DIGEST}",
            hint=_CORRUPT_HINT,
        )
    want = data[end:]
    got = hashlib.sha256(data[:end]).digest()
    if got != want:
        raise BackupError(
            f"backup file is corrupted: checksum mismatch (recorded sha256:{want.hex()}, "
            f"computed sha256:{got.hex()})",
            hint=_CORRUPT_HINT,
        )
    payload = data[off:end]
    if header.payload.encoding != PAYLOAD_ENCODING:
        raise BackupError(f"unknown payload encoding {header.payload.encoding!r}")
    if hashlib.sha256(payload).hexdigest() != header.payload.sha256:
        raise BackupError("backup file is corrupted: payload checksum mismatch", hint=_CORRUPT_HINT)
    try:
        return header, gzip.decompress(payload)
    except (OSError, EOFError, zlib.error) as e:
        raise BackupError(
            f"backup file is corrupted: payload does not decompress ({e})", hint=_CORRUPT_HINT
        ) from None


def checksum(data: bytes) -> str:
    """The file checksum as the API reports it (``sha256:<hex>``, the trailer)."""
    return "sha256:" + data[-_DIGEST:].hex() if len(data) >= _DIGEST else ""


class VerifyReport(msgspec.Struct, kw_only=True):
    header: BackupHeader
    checksum: str
    size_bytes: int
    counts: dict[str, int]


def verify(
    data: bytes, decode: Callable[[bytes], S] | None = None
) -> tuple[VerifyReport, S | StateView]:
    """The specification's verification checks: checksum, Raft metadata consistency
    (term, index, membership), deserialisation of the state (``decode``: bytes -> a
    state; default :class:`StateView`), and that the header's revision and counts are
    the state's. Returns the report and the decoded state; raises :class:`BackupError`."""
    header, raw = unpack(data)
    raft = header.raft
    ids = [m.get("id") for m in raft.members]
    if raft.term < 0 or raft.index < 0 or len(set(ids)) != len(ids):
        raise BackupError(
            f"backup file is inconsistent: Raft metadata term {raft.term}, index "
            f"{raft.index}, members {ids}",
            hint=_CORRUPT_HINT,
        )
    try:
        state: Any = (decode or _decode_view)(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BackupError(
            f"backup file does not deserialise: {e}",
            hint="It was written by an incompatible Lattice release, or damaged before it "
            "was checksummed.",
        ) from None
    counts = counts_of(state)
    if state.revision != header.revision or counts != header.counts:
        raise BackupError(
            f"backup file is inconsistent: the header says revision {header.revision} and "
            f"{header.counts}, the state holds revision {state.revision} and {counts}",
            hint=_CORRUPT_HINT,
        )
    report = VerifyReport(
        header=header, checksum=checksum(data), size_bytes=len(data), counts=counts
    )
    return report, state


def _decode_view(raw: bytes) -> StateView:
    return msgspec.msgpack.decode(raw, type=StateView)


def report_dict(report: VerifyReport) -> dict[str, Any]:
    """The report as the API and the CLI print it."""
    h = report.header
    return {
        "valid": True,
        "checksum": report.checksum,
        "size_bytes": report.size_bytes,
        "format_version": h.format_version,
        "lattice_version": h.lattice_version,
        "site": h.site,
        "created_at": h.created_at,
        "revision": h.revision,
        "raft_term": h.raft.term,
        "raft_index": h.raft.index,
        "members": [m.get("id") for m in h.raft.members],
        **report.counts,
    }


__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "BackupError",
    "BackupHeader",
    "PayloadInfo",
    "RaftPosition",
    "StateView",
    "VerifyReport",
    "checksum",
    "counts_of",
    "pack",
    "read_header",
    "report_dict",
    "unpack",
    "verify",
]
