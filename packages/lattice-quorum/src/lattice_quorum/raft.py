"""pysyncobj's ``SyncObj`` with two follower fixes to its ``append_entries`` handling.

1. **Commit only what was verified.** Raft lets a follower advance its commit index
   only to the last entry it verified against the leader's log ("min(leaderCommit,
   index of last new entry)"). pysyncobj advances it to the end of the follower's own
   log on every ``append_entries`` message that carries no ``prevLogIdx`` — the
   messages of a snapshot transfer. A deposed leader that rejoined while the new leader
   sent it a snapshot (its log was compacted meanwhile) therefore applied the
   uncommitted entries it had appended alone, at its old term, and answered their
   callbacks with SUCCESS: its clients were acknowledged for submissions the majority
   never committed, with allocation ids the majority gave to other submissions (found
   by the chaos suite, seed 42; ``tests/chaos/test_chaos_regressions.py``). Such a
   message's commit index is capped at the follower's current one; a snapshot that
   installs is committed by definition, so once loaded the commit index moves up to it.

2. **Never truncate entries that match.** Raft deletes a follower's entries only from
   the first one that conflicts with the leader's. pysyncobj deletes everything after
   ``prevLogIdx`` on every message, so a message re-sent from an older ``nextIndex``
   (after a reconnect or a stale "reset" answer) cut entries the follower had already
   acknowledged, even applied ones ("truncating already-applied log entries"); the leader,
   whose match index never goes down, could count the follower for a commit it no
   longer held. When every entry of such a message is already in the log at the same
   term and the log's last entry is of the leader's current term, the message is
   answered as a heartbeat at the end of the log when that whole log is known to be the
   leader's: its last entry is of the leader's term (by Raft's log matching property
   such an entry can only have come from that leader, and everything before it matches)
   or the whole log is committed (every leader holds every committed entry).

3. **The full dump yields the CPU.** pysyncobj writes its full dump (log compaction) in
   a forked child, so the member never waits for it, but the child pickles the whole
   state (25 s at 100,000 allocations and 10,000 nodes) on a core the member, its
   peers and the scheduler need. The child now runs at the lowest priority (nice 19)
   with the cyclic collector off (it exits when written; a collection there would only
   copy every page the parent shares with it). The member's own commits during a dump
   (fork, then copy-on-write of the pages it touches) stay within a few milliseconds of
   those outside it at 100,000 allocations; ``scripts/bench/scale.py`` measures it
   with the whole cluster on one machine.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

from pysyncobj import SyncObj

_writing_dump = False
"""True on the Raft thread while pysyncobj's serializer forks the dump writer: a child
forked then inherits True and knows it is that writer."""


def _after_fork_in_child() -> None:
    if _writing_dump:
        gc.disable()
        with contextlib.suppress(OSError):
            os.nice(19)


os.register_at_fork(after_in_child=_after_fork_in_child)


class SafeSyncObj(SyncObj):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        serializer = self._SyncObj__serializer  # type: ignore[attr-defined]
        serialize = serializer.serialize

        def serialize_marked(data: Any, id: Any) -> None:
            global _writing_dump
            _writing_dump = True
            try:
                serialize(data, id)
            finally:
                _writing_dump = False

        serializer.serialize = serialize_marked

    # pysyncobj registers ``self.__onMessageReceived`` with its transport; the name is
    # mangled to ``_SyncObj__onMessageReceived``, so defining it here overrides it.
    def _SyncObj__onMessageReceived(self, node: Any, message: dict[str, Any]) -> None:
        if not isinstance(message, dict) or message.get("type") != "append_entries":
            SyncObj._SyncObj__onMessageReceived(self, node, message)
            return
        if "prevLogIdx" in message:
            SyncObj._SyncObj__onMessageReceived(self, node, self._keep_matching_tail(message))
            return
        unverified = "commit_index" in message
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

    def _keep_matching_tail(self, message: dict[str, Any]) -> dict[str, Any]:
        """``message`` as it should be handled: unchanged, or, when it would only cut a
        tail that is already the leader's, a heartbeat at the end of the log."""
        if "transmission" in message or message.get("term") != self._SyncObj__raftCurrentTerm:
            return message
        log = self._SyncObj__raftLog
        last_idx, last_term = log[-1][1], log[-1][2]
        prev_idx = message["prevLogIdx"]
        entries = message.get("entries") or []
        end = entries[-1][1] if entries else prev_idx
        if end >= last_idx:
            return message  # nothing after the message to keep
        if last_term != message["term"] and last_idx > self._SyncObj__raftCommitIndex:
            return message  # an uncommitted tail of another term: maybe not the leader's
        first = log[0][1]
        if prev_idx < first or log[prev_idx - first][2] != message["prevLogTerm"]:
            return message  # the leader must go back further: pysyncobj answers that
        for _, idx, term in entries:
            if log[idx - first][2] != term:
                return message  # a conflict: truncating from there is right
        return {**message, "prevLogIdx": last_idx, "prevLogTerm": last_term, "entries": []}


__all__ = ["SafeSyncObj"]
