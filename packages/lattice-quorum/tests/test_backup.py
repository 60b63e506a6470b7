"""Backups: the container round-trips, every damage is detected, and RestoreBackup
replaces a fresh state (only a fresh one) with exactly what was backed up."""

from __future__ import annotations

import json
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common import backup as fmt
from lattice_common import commands as c
from lattice_common.backup import BackupError
from lattice_quorum import backup
from lattice_quorum.local import LocalQuorum
from lattice_quorum.state import GlobalState
from lattice_test_harness import builders as b

SEED: list[c.Command] = [
    c.CreateTenant(tenant=b.tenant("t"), now=1.0),
    c.CreateVCluster(vcluster=b.vcluster("v"), now=1.0),
    c.RegisterNode(node_id="n1", now=1.0),
    c.RegisterNode(node_id="n2", now=1.0),
    c.SubmitAllocation(spec=b.spec("sleep 1"), now=2.0),
    c.SubmitAllocation(spec=b.spec("true"), now=3.0),
]


def seeded() -> LocalQuorum:
    q = LocalQuorum()
    for cmd in SEED:
        assert q.apply(cmd).error is None
    return q


def backup_of(q: LocalQuorum, created_at: float = 10.0) -> bytes:
    return backup.build(backup.take(q), site="test", created_at=created_at)


_FILE = backup_of(seeded())


def test_round_trip_gives_back_the_same_state() -> None:
    q = seeded()
    data = backup_of(q)
    report, state = backup.verify(data)
    assert msgspec.msgpack.encode(state) == msgspec.msgpack.encode(q.state)
    assert report.counts == {
        "allocations": 2,
        "nodes": 2,
        "tenants": 1,
        "vclusters": 1,
        "audit_entries": 0,
    }
    h = report.header
    assert h.revision == q.revision and h.site == "test" and h.created_at == 10.0
    assert h.raft.members == [{"id": 1, "address": "local:0"}]
    assert report.checksum.startswith("sha256:") and report.size_bytes == len(data)
    # the CLI's own check (no lattice_quorum) reads the same counts
    view_report, view = fmt.verify(data)
    assert view_report.counts == report.counts and set(view.allocations) == set(q.state.allocations)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_single_byte_corruption_is_refused(data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, len(_FILE) - 1))
    flip = data.draw(st.integers(1, 255))
    damaged = bytearray(_FILE)
    damaged[pos] ^= flip
    with pytest.raises(BackupError):
        backup.verify(bytes(damaged))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(_FILE) - 1))
def test_any_truncation_is_refused(keep: int) -> None:
    with pytest.raises(BackupError):
        backup.verify(_FILE[:keep])


def test_a_corruption_names_the_checksum_mismatch() -> None:
    damaged = bytearray(_FILE)
    damaged[-40] ^= 0x01  # inside the payload
    with pytest.raises(BackupError, match="corrupted: checksum mismatch") as e:
        backup.verify(bytes(damaged))
    assert e.value.hint


def _with_header(data: bytes, **changes: object) -> bytes:
    """A file whose header fields differ (checksum recomputed: a well-formed file)."""
    header, off = fmt.read_header(data)
    fields = {**msgspec.to_builtins(header), **changes}
    head = json.dumps(fields, sort_keys=True).encode()
    import hashlib

    body = fmt.MAGIC + struct.pack(">I", len(head)) + head + data[off:-32]
    return body + hashlib.sha256(body).digest()


def test_a_newer_format_is_refused_with_the_versions() -> None:
    newer = _with_header(_FILE, format_version=fmt.FORMAT_VERSION + 1)
    with pytest.raises(BackupError) as e:
        backup.verify(newer)
    assert str(e.value) == (
        f"backup format version {fmt.FORMAT_VERSION + 1} is newer than this Lattice "
        f"supports ({fmt.FORMAT_VERSION})"
    )
    assert "release" in e.value.hint


def test_header_that_disagrees_with_the_state_is_refused() -> None:
    with pytest.raises(BackupError, match="inconsistent"):
        backup.verify(_with_header(_FILE, revision=999))
    with pytest.raises(BackupError, match="inconsistent: Raft metadata"):
        backup.verify(_with_header(_FILE, raft={"term": 1, "index": 2, "members": [{"id": 1}] * 2}))


def test_not_a_backup() -> None:
    with pytest.raises(BackupError, match="not a Lattice backup"):
        backup.verify(b"PK\x03\x04 a zip file")


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=0, max_size=4, unique=True),
    st.integers(0, 5),
)
def test_round_trip_of_generated_states(tenants: list[str], jobs: int) -> None:
    q = LocalQuorum()
    for name in tenants:
        assert q.apply(c.CreateTenant(tenant=b.tenant(name), now=1.0)).error is None
    for i in range(jobs):
        q.apply(c.SubmitAllocation(spec=b.spec(f"echo {i}"), now=2.0 + i))
    _report, state = backup.verify(backup_of(q))
    assert msgspec.msgpack.encode(state) == msgspec.msgpack.encode(q.state)


def test_restore_replaces_a_fresh_state_exactly() -> None:
    source = seeded()
    fresh = LocalQuorum()
    res = fresh.apply(c.RestoreBackup(data=backup_of(source), now=20.0))
    assert res.error is None, res.error
    assert msgspec.msgpack.encode(fresh.state) == msgspec.msgpack.encode(source.state)
    # and the restored cluster goes on from there
    res = fresh.apply(c.SubmitAllocation(spec=b.spec("true"), now=21.0))
    assert res.error is None and res.allocation is not None
    assert res.allocation.id not in source.state.allocations


def test_restore_refuses_a_state_that_is_not_fresh() -> None:
    target = LocalQuorum()
    target.apply(c.CreateTenant(tenant=b.tenant("other"), now=1.0))
    before = msgspec.msgpack.encode(target.state)
    res = target.apply(c.RestoreBackup(data=_FILE, now=2.0))
    assert res.error is not None and res.error["code"] == "failed_precondition"
    assert "freshly bootstrapped" in res.error["message"]
    assert msgspec.msgpack.encode(target.state) == before


def test_restore_refuses_a_corrupted_file_and_changes_nothing() -> None:
    fresh = LocalQuorum()
    damaged = bytearray(_FILE)
    damaged[len(damaged) // 2] ^= 0xFF
    res = fresh.apply(c.RestoreBackup(data=bytes(damaged), now=2.0))
    assert res.error is not None and "corrupted" in res.error["message"]
    assert msgspec.msgpack.encode(fresh.state) == msgspec.msgpack.encode(GlobalState())


def test_nodes_that_registered_before_the_restore_are_kept() -> None:
    # the other members of a restored quorum serve before the restore is committed:
    # agents may register their nodes there first
    fresh = LocalQuorum()
    assert fresh.apply(c.RegisterNode(node_id="n1", now=5.0)).error is None  # in the backup
    assert fresh.apply(c.RegisterNode(node_id="new", now=5.0)).error is None  # not in it
    source = seeded()
    res = fresh.apply(c.RestoreBackup(data=backup_of(source), now=20.0))
    assert res.error is None, res.error
    assert set(fresh.state.nodes) == {"n1", "n2", "new"}
    assert fresh.state.nodes["n1"] == source.state.nodes["n1"]
    assert fresh.state.allocations == source.state.allocations
    assert fresh.state.revision == source.state.revision
