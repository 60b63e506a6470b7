"""A follower applies only entries it verified against the leader's log.

Real pysyncobj members driven tick by tick (no auto-tick thread), so the message that
used to make a deposed leader apply its own uncommitted entries is delivered exactly.
"""

from __future__ import annotations

import time

import pytest
from lattice_cli.devcluster import free_port
from lattice_quorum.raft import SafeSyncObj
from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, replicated


class Counter(SyncObjConsumer):
    def __init__(self) -> None:
        super().__init__()
        self.value = 0

    @replicated
    def add(self, n: int) -> int:
        self.value += n
        return self.value


def _addr() -> str:
    return f"127.0.0.1:{free_port()}"


def _conf() -> SyncObjConf:
    return SyncObjConf(
        autoTick=False,
        dynamicMembershipChange=True,
        appendEntriesPeriod=0.01,
        raftMinTimeout=0.05,
        raftMaxTimeout=0.1,
    )


def _command_bytes(n: int) -> bytes:
    """The raw Raft entry of ``Counter.add(n)``, made by a one-member leader."""
    counter = Counter()
    leader = SyncObj(_addr(), [], conf=_conf(), consumers=[counter])
    try:
        deadline = time.monotonic() + 10
        while not leader._isLeader() and time.monotonic() < deadline:
            leader.doTick(0.01)
        counter.add(n)
        while counter.value != n and time.monotonic() < deadline:
            leader.doTick(0.01)
        assert counter.value == n
        return leader._SyncObj__raftLog[-1][0]
    finally:
        leader.destroy()


def _deposed_leader(cls: type[SyncObj], uncommitted: list[bytes]) -> tuple[SyncObj, Counter]:
    """A member whose log ends with entries it appended alone (at term 1) and never
    committed: what a leader has after a partition cut it off from the majority."""
    counter = Counter()
    member = cls(_addr(), [_addr(), _addr()], conf=_conf(), consumers=[counter])
    log = member._SyncObj__raftLog
    first = log[-1][1]
    for i, raw in enumerate(uncommitted, start=first + 1):
        log.add(raw, i, 1)
    return member, counter


def _snapshot_message(commit_index: int) -> dict:
    # what the new leader (term 2) sends while it transfers a snapshot to a member
    # whose missing entries it already compacted away
    return {"type": "append_entries", "term": 2, "commit_index": commit_index, "serialized": None}


def _deliver(member: SyncObj, message: dict) -> None:
    node = next(iter(member._SyncObj__otherNodes))
    member._SyncObj__onMessageReceived(node, message)
    for _ in range(20):
        member.doTick(0.0)


def test_a_snapshot_transfer_does_not_commit_the_followers_own_entries():
    raw = _command_bytes(5)
    member, counter = _deposed_leader(SafeSyncObj, [raw, raw, raw])
    try:
        before = member._SyncObj__raftCommitIndex
        _deliver(member, _snapshot_message(commit_index=100))
        assert counter.value == 0, "entries no majority committed were applied"
        assert member._SyncObj__raftCommitIndex == before
    finally:
        member.destroy()


def test_plain_pysyncobj_applies_them_which_is_why_the_fix_exists():
    """Pins the upstream behaviour the fix works around: should pysyncobj change, this
    fails and the override can be reconsidered."""
    raw = _command_bytes(5)
    member, counter = _deposed_leader(SyncObj, [raw, raw, raw])
    try:
        _deliver(member, _snapshot_message(commit_index=100))
        assert counter.value == 15
    finally:
        member.destroy()


def test_verified_entries_still_commit_on_the_safe_member():
    raw = _command_bytes(2)
    member, counter = _deposed_leader(SafeSyncObj, [])
    try:
        last = member._SyncObj__raftLog[-1]
        msg = {
            "type": "append_entries",
            "term": 2,
            "commit_index": last[1] + 2,
            "prevLogIdx": last[1],
            "prevLogTerm": last[2],
            "entries": [(raw, last[1] + 1, 2), (raw, last[1] + 2, 2)],
        }
        _deliver(member, msg)
        assert counter.value == 4
    finally:
        member.destroy()


def _follower_at_term(cls: type[SyncObj], raw: bytes, count: int, term: int) -> SyncObj:
    """A follower whose log ends with ``count`` entries the leader of ``term`` sent it."""
    member = cls(_addr(), [_addr(), _addr()], conf=_conf(), consumers=[Counter()])
    member._SyncObj__raftCurrentTerm = term
    log = member._SyncObj__raftLog
    first = log[-1][1]
    for i in range(first + 1, first + 1 + count):
        log.add(raw, i, term)
    return member


def _resent(member: SyncObj, raw: bytes, upto: int, term: int) -> dict:
    """The leader re-sending, from an older nextIndex, entries the follower has."""
    log = member._SyncObj__raftLog
    first = log[0]
    return {
        "type": "append_entries",
        "term": term,
        "commit_index": 0,
        "prevLogIdx": first[1],
        "prevLogTerm": first[2],
        "entries": [(raw, i, term) for i in range(first[1] + 1, upto + 1)],
    }


def test_a_resent_message_does_not_cut_entries_the_follower_acknowledged():
    raw = _command_bytes(1)
    member = _follower_at_term(SafeSyncObj, raw, count=6, term=3)
    try:
        last = member._SyncObj__raftLog[-1][1]
        _deliver(member, _resent(member, raw, upto=last - 4, term=3))
        assert member._SyncObj__raftLog[-1][1] == last
    finally:
        member.destroy()


def test_plain_pysyncobj_cuts_them():
    raw = _command_bytes(1)
    member = _follower_at_term(SyncObj, raw, count=6, term=3)
    try:
        last = member._SyncObj__raftLog[-1][1]
        _deliver(member, _resent(member, raw, upto=last - 4, term=3))
        assert member._SyncObj__raftLog[-1][1] == last - 4
    finally:
        member.destroy()


def test_a_tail_of_an_older_term_is_still_replaced_by_the_leaders_entries():
    raw, other = _command_bytes(1), _command_bytes(7)
    member = _follower_at_term(SafeSyncObj, raw, count=6, term=2)
    try:
        member._SyncObj__raftCurrentTerm = 3
        log = member._SyncObj__raftLog
        first = log[0]
        msg = {
            "type": "append_entries",
            "term": 3,
            "commit_index": first[1] + 2,
            "prevLogIdx": first[1],
            "prevLogTerm": first[2],
            "entries": [(other, first[1] + 1, 3), (other, first[1] + 2, 3)],
        }
        _deliver(member, msg)
        assert member._SyncObj__raftLog[-1][1] == first[1] + 2
        assert member._SyncObj__raftLog[-1][2] == 3
    finally:
        member.destroy()


def test_a_committed_tail_of_an_older_term_is_kept():
    """A member restarted after a leader change holds committed entries of the old term;
    the new leader re-sending the first of them must not cut the rest."""
    raw = _command_bytes(1)
    member = _follower_at_term(SafeSyncObj, raw, count=6, term=2)
    try:
        last = member._SyncObj__raftLog[-1][1]
        member._SyncObj__raftCommitIndex = last
        member._SyncObj__raftCurrentTerm = 3
        msg = _resent(member, raw, upto=last - 4, term=2)
        msg["term"] = 3
        _deliver(member, msg)
        assert member._SyncObj__raftLog[-1][1] == last
    finally:
        member.destroy()


def _applied(member: SyncObj, upto: int) -> None:
    member._SyncObj__raftCommitIndex = upto
    member._SyncObj__raftLastApplied = upto


def _cut_applied(caplog: pytest.LogCaptureFixture) -> bool:
    return any("truncating already-applied" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("cls", "cuts"), [(SafeSyncObj, False), (SyncObj, True)])
def test_a_resent_message_reaching_past_the_log_only_appends(
    caplog: pytest.LogCaptureFixture, cls: type[SyncObj], cuts: bool
) -> None:
    """A member that has just loaded a snapshot (or reconnected) is sent entries it has
    already applied followed by new ones: the new ones are appended and nothing applied
    is cut, so pysyncobj's critical "truncating already-applied" line stays silent.
    Plain pysyncobj cuts and re-adds them, and says so (pinned: should it change, the
    override can be reconsidered)."""
    raw = _command_bytes(1)
    member = _follower_at_term(cls, raw, count=6, term=3)
    try:
        last = member._SyncObj__raftLog[-1][1]
        _applied(member, last)
        _deliver(member, _resent(member, raw, upto=last + 2, term=3))
        assert member._SyncObj__raftLog[-1][1] == last + 2
        assert _cut_applied(caplog) == cuts
    finally:
        member.destroy()


def test_an_uncommitted_tail_of_an_older_term_is_cut_above_the_commit_index_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Entries of an older term beyond the message may not be the leader's: those above
    the commit index go; the committed (and applied) ones are every leader's and stay."""
    raw = _command_bytes(1)
    member = _follower_at_term(SafeSyncObj, raw, count=6, term=2)
    try:
        member._SyncObj__raftCurrentTerm = 3
        first = member._SyncObj__raftLog[0][1]
        _applied(member, first + 3)
        msg = _resent(member, raw, upto=first + 2, term=2)
        msg["term"] = 3
        _deliver(member, msg)
        assert member._SyncObj__raftLog[-1][1] == first + 3
        assert not _cut_applied(caplog)
    finally:
        member.destroy()


def test_a_conflicting_entry_still_replaces_the_rest_from_there() -> None:
    raw, other = _command_bytes(1), _command_bytes(7)
    member = _follower_at_term(SafeSyncObj, raw, count=6, term=2)
    try:
        member._SyncObj__raftCurrentTerm = 3
        first = member._SyncObj__raftLog[0][1]
        msg = {
            "type": "append_entries",
            "term": 3,
            "commit_index": 0,
            "prevLogIdx": first,
            "prevLogTerm": member._SyncObj__raftLog[0][2],
            # two entries the member holds, then one that conflicts with its third
            "entries": [(raw, first + 1, 2), (raw, first + 2, 2), (other, first + 3, 3)],
        }
        _deliver(member, msg)
        log = member._SyncObj__raftLog
        assert log[-1][1] == first + 3 and log[-1][2] == 3
        assert [e[2] for e in log[1:]] == [2, 2, 3]
    finally:
        member.destroy()
