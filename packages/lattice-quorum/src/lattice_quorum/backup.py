"""Backups of the replicated state: take one, check one, decode one.

The container (magic, header, checksum, format version) is lattice_common.backup's; this
module adds what needs the quorum's own types: the snapshot of a GlobalState at one
applied index and the full typed decoding used by verify and restore.

Consistency: :func:`snapshot` runs through ``quorum.read`` (under the apply lock), so it
sees the state after exactly one applied Raft entry and reads the member's term, last
applied index and membership at that same point. Inside the lock it only encodes the
state with msgspec (see scripts/bench/backup.py); compression and checksums happen
after the lock is released, so commits stall only for the encoding.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec
from lattice_common import backup as fmt
from lattice_common.backup import BackupError, BackupHeader, RaftPosition, VerifyReport

from lattice_quorum.global_state import GlobalState

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GlobalState)


def lattice_version() -> str:
    try:
        return importlib.metadata.version("lattice-quorum")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover (source tree)
        return "unknown"


class Snapshot(msgspec.Struct, kw_only=True):
    """What :func:`snapshot` takes under the lock: the encoded state and where it is."""

    state: bytes
    revision: int
    counts: dict[str, int]
    raft: RaftPosition


def snapshot(state: GlobalState, status: dict[str, Any]) -> Snapshot:
    """Encode ``state`` (call under the apply lock, e.g. ``quorum.read(snapshot, st)``
    with ``st`` = ``quorum.status()`` read inside the same lock by :func:`take`)."""
    members = [{"id": m.get("id"), "address": m.get("address", "")} for m in status["members"]]
    return Snapshot(
        state=_encoder.encode(state),
        revision=state.revision,
        counts=fmt.counts_of(state),
        raft=RaftPosition(
            term=int(status.get("term", 0)),
            index=int(status.get("last_applied", 0)),
            members=members,
        ),
    )


def take(quorum: Any) -> Snapshot:
    """One consistent snapshot of a Quorum (QuorumMember or LocalQuorum): the state,
    its revision and the Raft position, all at one applied index."""
    return quorum.read(lambda st: snapshot(st, quorum.status()))


def build(snap: Snapshot, *, site: str, created_at: float, level: int = 6) -> bytes:
    """The backup file of a snapshot (compression and checksums: outside the lock)."""
    header = BackupHeader(
        lattice_version=lattice_version(),
        site=site,
        created_at=created_at,
        revision=snap.revision,
        raft=snap.raft,
        counts=snap.counts,
    )
    return fmt.pack(header, snap.state, level=level)


def decode_state(raw: bytes) -> GlobalState:
    """The full typed decoding of a payload (every record, every field)."""
    return _decoder.decode(raw)


def verify(data: bytes) -> tuple[VerifyReport, GlobalState]:
    """lattice_common.backup.verify with the full GlobalState decoding."""
    report, state = fmt.verify(data, decode_state)
    assert isinstance(state, GlobalState)
    return report, state


def is_fresh(state: GlobalState) -> bool:
    """A freshly bootstrapped state, which a restore may replace: no allocation, tenant,
    vCluster, DAG, session or CA. Node registrations and audit entries may be there:
    while member 1 waits for a majority to restore, the other members already serve,
    and agents that reconnect register their nodes (see handlers.backup)."""
    return not (
        state.allocations
        or state.tenants
        or state.vclusters
        or state.dags
        or state.sessions
        or state.ca_cert_pem
    )


__all__ = [
    "BackupError",
    "Snapshot",
    "build",
    "decode_state",
    "is_fresh",
    "lattice_version",
    "snapshot",
    "take",
    "verify",
]
