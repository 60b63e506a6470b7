"""pysyncobj's ``SyncObj`` with two follower fixes to its ``append_entries`` handling, a
gentler full dump and a lone leader that commits without waiting for its next tick.

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
   (after a reconnect, a stale "reset" answer, or to a member that has just loaded a
   snapshot) cut entries the follower had already acknowledged, even applied ones
   ("truncating already-applied log entries", logged as critical); the leader, whose
   match index never goes down, could count the follower for a commit it no longer
   held. Entries of the message that the log already holds at the same term are now
   skipped, so the cut starts at the first conflict. A message with nothing new is
   answered as a heartbeat at the end of the log when that whole log is known to be the
   leader's: its last entry is of the leader's term (by Raft's log matching property
   such an entry can only have come from that leader, and everything before it
   matches) or the whole log is committed (every leader holds every committed entry).
   Otherwise only the uncommitted tail above the message is cut (it may not be the
   leader's). The critical log line now means what it says: an applied entry
   conflicted with the leader's.

3. **The full dump yields the CPU.** pysyncobj writes its full dump (log compaction) in
   a forked child, so the member never waits for it, but the child pickles the whole
   state (25 s at 100,000 allocations and 10,000 nodes) on a core the member, its
   peers and the scheduler need. The child now runs at the lowest priority (nice 19)
   with the cyclic collector off (it exits when written; a collection there would only
   copy every page the parent shares with it). The member's own commits during a dump
   (fork, then copy-on-write of the pages it touches) stay within a few milliseconds of
   those outside it at 100,000 allocations; ``scripts/bench/scale.py`` measures it
   with the whole cluster on one machine.

4. **A lone leader commits at once.** pysyncobj appends the commands it took from its
   queue at the end of a tick and computes the commit index at the start of the next,
   which begins when a message arrives or after ``autoTickPeriod``. A leader with
   followers is woken by their answers; a single-member quorum (the embedded default)
   has nothing to wake it, so every commit waited a whole tick (2 ms; a trivial job's
   turnaround on a node holds two commits). Such a leader now wakes its own poll when it
   has appended something, and the next tick commits it.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

from pysyncobj import SyncObj
from pysyncobj.syncobj import _RAFT_STATE

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

    def _checkCommandsToApply(self) -> None:
        if self._SyncObj__otherNodes:  # followers' answers end the poll
            super()._checkCommandsToApply()
            return
        appended_from = self._SyncObj__getCurrentLogIndex()
        super()._checkCommandsToApply()
        # (no notifier when pysyncobj batches its append_entries: it ticks without waiting)
        notifier = getattr(self, "_SyncObj__pipeNotifier", None)
        if (
            notifier is not None
            and self._SyncObj__raftState == _RAFT_STATE.LEADER
            and self._SyncObj__getCurrentLogIndex() > appended_from
        ):
            notifier.notify()  # nothing else will end the poll

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
        """``message`` as Raft would have it handled: entries the log already holds at
        the same term are skipped, so pysyncobj (which deletes everything after the
        message's ``prevLogIdx``) cuts the log only from the first entry that conflicts;
        a message that brings nothing new becomes a heartbeat at the end of what is
        known to be the leader's."""
        if "transmission" in message or message.get("term") != self._SyncObj__raftCurrentTerm:
            return message
        log = self._SyncObj__raftLog
        first = log[0][1]
        last_idx, last_term = log[-1][1], log[-1][2]
        prev_idx = message["prevLogIdx"]
        if prev_idx < first or prev_idx > last_idx:
            return message  # the leader must go back (or on): pysyncobj answers that
        if log[prev_idx - first][2] != message["prevLogTerm"]:
            return message
        entries = message.get("entries") or []
        held = 0
        for _, idx, term in entries:
            if idx > last_idx or log[idx - first][2] != term:
                break
            held += 1
        if held < len(entries):  # from here on new or conflicting: handled from there
            if held == 0:
                return message
            _, idx, term = entries[held - 1]
            return {**message, "prevLogIdx": idx, "prevLogTerm": term, "entries": entries[held:]}
        end = entries[-1][1] if entries else prev_idx
        if end < last_idx and last_term != message["term"]:
            commit = self._SyncObj__raftCommitIndex
            if last_idx > commit:
                # an uncommitted tail of another term: maybe not the leader's, and cut;
                # what is committed is the leader's (every leader holds it) and stays
                keep = max(end, commit)
                return {
                    **message,
                    "prevLogIdx": keep,
                    "prevLogTerm": log[keep - first][2],
                    "entries": [],
                }
        # everything here is the leader's: its last entry is of the leader's term (by
        # log matching, so is all before it), or the whole log is committed
        return {**message, "prevLogIdx": last_idx, "prevLogTerm": last_term, "entries": []}


__all__ = ["SafeSyncObj"]
