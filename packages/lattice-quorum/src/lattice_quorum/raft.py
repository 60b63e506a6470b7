"""pysyncobj's ``SyncObj`` with a follower commit-index fix.

Raft lets a follower advance its commit index only to the last entry it has *verified*
against the leader's log ("min(leaderCommit, index of last new entry)"). pysyncobj
advances it to the end of the follower's own log on every ``append_entries`` message
that carries no ``prevLogIdx`` — the messages of a snapshot transfer. A deposed leader
that rejoins while the new leader sends it a snapshot (its log was compacted meanwhile)
therefore applied the uncommitted entries it had appended alone, at its old term, and
answered their callbacks with SUCCESS: its clients were acknowledged for submissions
the majority never committed, with allocation ids the majority gave to other
submissions (found by the chaos suite, seed 42, and pinned by
``tests/chaos/test_chaos_regressions.py``).

The fix caps the commit index such a message may carry at the follower's current one;
a snapshot that installs is committed by definition, so once it is loaded the commit
index moves up to it. Entries with ``prevLogIdx`` are untouched: pysyncobj truncates
the log after the verified prefix before it reads the commit index there.
"""

from __future__ import annotations

from typing import Any

from pysyncobj import SyncObj


class SafeSyncObj(SyncObj):
    # pysyncobj registers ``self.__onMessageReceived`` with its transport; the name is
    # mangled to ``_SyncObj__onMessageReceived``, so defining it here overrides it.
    def _SyncObj__onMessageReceived(self, node: Any, message: dict[str, Any]) -> None:
        unverified = (
            isinstance(message, dict)
            and message.get("type") == "append_entries"
            and "prevLogIdx" not in message
            and "commit_index" in message
        )
        if unverified:
            own = self._SyncObj__raftCommitIndex
            if message["commit_index"] > own:
                message = {**message, "commit_index": own}
        SyncObj._SyncObj__onMessageReceived(self, node, message)
        if unverified:
            applied = self._SyncObj__raftLastApplied
            if applied > self._SyncObj__raftCommitIndex:  # a snapshot was installed
                self._SyncObj__raftCommitIndex = applied
                self._SyncObj__raftLog.setRaftCommitIndex(applied)


__all__ = ["SafeSyncObj"]
