"""A quorum member in trouble says so: a damaged Raft snapshot (raft.dump) stops it from
starting instead of serving the empty state pysyncobj would fall back to, and a commit
that never completes is Unavailable (HTTP 503), not an unhandled error."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from lattice_cli.devcluster import free_port
from lattice_common import commands as c
from lattice_common.errors import Unavailable, ValidationError
from lattice_quorum.member import QuorumMember
from lattice_test_harness import builders as b

pytestmark = pytest.mark.timeout(120)


def make_member(data_dir: Path, *, bootstrap: bool) -> QuorumMember:
    return QuorumMember(
        node_id=1, bind=f"127.0.0.1:{free_port()}", peers={}, data_dir=data_dir, bootstrap=bootstrap
    )


async def write_snapshot(data_dir: Path) -> int:
    """A member with some state and a full dump on disk; its revision."""
    m = make_member(data_dir, bootstrap=True)
    try:
        m.attach_loop(asyncio.get_running_loop())
        deadline = time.monotonic() + 15
        while not m.is_leader:
            assert time.monotonic() < deadline, "no leadership"
            await asyncio.sleep(0.02)
        assert (await m.propose(c.CreateTenant(tenant=b.tenant("t"), now=1.0))).error is None
        m.syncobj.forceLogCompaction()
        dump = data_dir / "raft.dump"
        while not dump.exists() or dump.stat().st_size == 0:
            assert time.monotonic() < deadline, "no raft.dump written"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the dump is written by a forked child, then renamed
        return m.revision
    finally:
        m.close()


async def test_a_readable_snapshot_restores_the_state(tmp_path: Path) -> None:
    rev = await write_snapshot(tmp_path)
    m = make_member(tmp_path, bootstrap=False)
    try:
        m.attach_loop(asyncio.get_running_loop())
        deadline = time.monotonic() + 15
        while m.revision < rev:
            assert time.monotonic() < deadline, f"revision {m.revision}, wanted {rev}"
            await asyncio.sleep(0.05)
        assert m.read(lambda s: "t" in s.tenants)
    finally:
        m.close()


async def test_a_corrupted_snapshot_refuses_to_start_with_a_hint(tmp_path: Path) -> None:
    await write_snapshot(tmp_path)
    dump = tmp_path / "raft.dump"
    data = bytearray(dump.read_bytes())
    for i in range(20, len(data), max(1, len(data) // 8)):
        data[i] ^= 0xFF
    dump.write_bytes(bytes(data))
    with pytest.raises(ValidationError) as ei:
        make_member(tmp_path, bootstrap=False)
    assert "cannot be read" in ei.value.message and str(dump) in ei.value.message
    assert "catches up from its peers" in ei.value.hint


async def test_a_commit_without_a_majority_is_unavailable_with_a_hint(tmp_path: Path) -> None:
    # two peers that never answer: no leader, and pysyncobj never calls back
    peers = {2: f"127.0.0.1:{free_port()}", 3: f"127.0.0.1:{free_port()}"}
    m = QuorumMember(
        node_id=1,
        bind=f"127.0.0.1:{free_port()}",
        peers=peers,
        data_dir=tmp_path,
        bootstrap=True,
        commit_timeout=0.5,
    )
    try:
        m.attach_loop(asyncio.get_running_loop())
        with pytest.raises(Unavailable) as ei:
            await m.propose(c.CreateTenant(tenant=b.tenant("t"), now=1.0))
        assert "not confirmed" in ei.value.message or "Raft commit failed" in ei.value.message
        assert "majority" in ei.value.hint
    finally:
        m.close()


async def test_a_snapshot_whose_content_changed_is_refused_before_it_is_loaded(
    tmp_path: Path,
) -> None:
    """The chaos suite's corrupt_snapshot fault flips a few bytes: gzip's CRC-32 and
    length find any change of the content, before anything is unpickled. (A flip in the
    header's file name or timestamp, or in deflate padding, changes no content.)"""
    import gzip

    await write_snapshot(tmp_path)
    dump = tmp_path / "raft.dump"
    good = dump.read_bytes()
    content = gzip.decompress(good)
    refused = 0
    for i in range(0, len(good), max(1, len(good) // 40)):
        data = bytearray(good)
        data[i] ^= 0x01
        dump.write_bytes(bytes(data))
        try:
            make_member(tmp_path, bootstrap=False).close()
        except ValidationError:
            refused += 1
        else:
            assert gzip.decompress(bytes(data)) == content, f"byte {i} changed content"
    assert refused >= 30
    dump.write_bytes(good[:-3])  # truncated
    with pytest.raises(ValidationError):
        make_member(tmp_path, bootstrap=False)
