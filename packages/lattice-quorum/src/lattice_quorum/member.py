"""One Raft member: pysyncobj underneath, asyncio on top.

pysyncobj runs Raft on its own thread and calls the replicated method there. This
module keeps that thread boundary in one place: proposals from asyncio code are
micro-batched (everything proposed in one loop iteration becomes one Raft entry),
handed to pysyncobj, and its callback resolves asyncio futures through
``call_soon_threadsafe``. Reads take the same lock apply holds, so a reader never sees
half a command. Watchers receive a snapshot, then one encoded delta per applied entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lattice_common import commands as c
from lattice_common import heap
from lattice_common.errors import LatticeError, NotLeader, Unavailable, ValidationError
from prometheus_client import Gauge, Histogram
from pysyncobj import FAIL_REASON, SyncObjConf, SyncObjConsumer, replicated

from lattice_quorum.quorum import encode_changes, encode_snapshot
from lattice_quorum.raft import SafeSyncObj
from lattice_quorum.state import Changes, GlobalState, apply

T = TypeVar("T")

log = logging.getLogger("lattice.quorum")

COMMIT_LATENCY = Histogram(
    "lattice_raft_commit_latency_seconds",
    "Time from proposal to commit",
    ["member_id"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
RAFT_LEADER = Gauge(
    "lattice_raft_leader", "1 if this member is leader, 0 if follower", ["member_id"]
)
RAFT_LOG_ENTRIES = Gauge(
    "lattice_raft_log_entries", "Number of entries in the Raft log", ["member_id"]
)

MARKER = "cluster.json"


class StateMachine(SyncObjConsumer):
    """The replicated object. Attributes set before ``super().__init__`` are local;
    ``self.state`` (set after) is what pysyncobj snapshots into the full dump."""

    def __init__(
        self, on_applied: Callable[[GlobalState, Changes], None], on_reset: Callable[[], None]
    ):
        self._lock = threading.RLock()
        self._on_applied = on_applied
        self._on_reset = on_reset
        super().__init__()
        self.state = GlobalState()

    @replicated
    def apply_command(self, raw: bytes) -> bytes:
        cmd = c.decode_command(raw)
        changes = Changes()
        with self._lock:
            result = apply(self.state, cmd, changes)
            if changes:
                self._on_applied(self.state, changes)
        return c.encode_result(result)

    def _deserialize(self, data: Any) -> None:  # full dump loaded (restart or catch-up)
        with self._lock:
            super()._deserialize(data)
        # the whole state was just built: keep it out of the collector's full walks
        heap.freeze()
        self._on_reset()


class QuorumMember:
    """Runs one member and exposes propose / read / watch to asyncio code (the
    :class:`lattice_quorum.quorum.Quorum` protocol)."""

    def __init__(
        self,
        *,
        node_id: int,
        bind: str,
        peers: dict[int, str],
        data_dir: str | os.PathLike[str],
        bootstrap: bool = False,
        append_entries_period: float = 0.01,
        auto_tick_period: float = 0.002,
        raft_min_timeout: float = 0.5,
        raft_max_timeout: float = 1.0,
        commit_timeout: float = 5.0,
        log_compaction_min_entries: int = 20000,
        log_compaction_min_time: float = 300.0,
        raft_password: str | None = None,
    ) -> None:
        """``raft_password`` (``quorum.raft_password``, the same on every member)
        encrypts and authenticates all Raft peer traffic (pysyncobj's ``password``:
        Fernet with a PBKDF2-derived key); a peer without it is disconnected on its
        first message. ``None`` = plaintext, unauthenticated Raft (dev only). It is
        never logged nor kept on this object."""
        if raft_password is not None and not raft_password.strip():
            raise ValidationError(
                "quorum.raft_password must not be empty",
                hint="Set the same non-empty secret on every member, or leave it unset "
                "for an unencrypted dev quorum.",
            )
        self.node_id = node_id
        self.bind = bind
        self.peers = dict(peers)  # other members: id -> raft address
        self.data_dir = Path(data_dir)
        self.commit_timeout = commit_timeout
        self._check_bootstrap(bootstrap)
        self._check_dump()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchers: set[asyncio.Queue[bytes | None]] = set()
        self._pending: list[tuple[c.Command, asyncio.Future[c.CommandResult], float]] = []
        self._flush_scheduled = False
        self._leader_callbacks: list[Callable[[bool], None]] = []
        self._member_label = str(node_id)
        self.sm = StateMachine(self._on_applied, self._on_reset)
        conf = SyncObjConf(
            journalFile=str(self.data_dir / "raft.journal"),
            fullDumpFile=str(self.data_dir / "raft.dump"),
            appendEntriesPeriod=append_entries_period,
            autoTickPeriod=auto_tick_period,
            raftMinTimeout=max(raft_min_timeout, 3.5 * append_entries_period),
            raftMaxTimeout=max(raft_max_timeout, 7 * append_entries_period),
            connectionRetryTime=0.5,
            connectionTimeout=max(3.5, 2 * raft_max_timeout),
            logCompactionMinEntries=log_compaction_min_entries,
            logCompactionMinTime=log_compaction_min_time,
            commandsWaitLeader=True,
            appendEntriesUseBatch=False,
            onStateChanged=self._on_raft_state,
            dynamicMembershipChange=True,
            password=raft_password,
        )
        self.encrypted = raft_password is not None
        self.syncobj = SafeSyncObj(bind, list(self.peers.values()), conf=conf, consumers=[self.sm])
        # Members started together (a quorum on one host, a cluster brought up at once)
        # would all write their full dump at the same moment, each forking and pickling
        # the whole state on the same cores: with three 10,000-node members on one
        # 2-core machine, commits then waited up to 0.2 s instead of 0.07 s. Member k of
        # n starts its compaction clock (k-1)/n of the interval early, so they take turns.
        members = len(self.peers) + 1
        stagger = ((node_id - 1) % members) / members * log_compaction_min_time
        self.syncobj._SyncObj__lastSerializedTime -= stagger  # type: ignore[attr-defined]
        # pysyncobj reads the password once, in SyncObj.__init__, to derive its Fernet
        # key; drop the clear text so it does not linger on the conf object.
        conf.password = None
        if self.encrypted:
            log.info("member %s: Raft peer traffic encrypted and authenticated", node_id)
        elif self.peers:
            log.warning(
                "member %s: Raft peer traffic is NOT encrypted or authenticated; set "
                "quorum.raft_password (LATTICE_RAFT_PASSWORD) on every member and bind "
                "quorum.bind to a private management interface",
                node_id,
            )

    # --- bootstrap ----------------------------------------------------------------

    def _check_bootstrap(self, bootstrap: bool) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        marker = self.data_dir / MARKER
        if marker.exists():
            if bootstrap:
                raise ValidationError(
                    f"member {self.node_id} is already bootstrapped (found {marker})",
                    hint="--bootstrap is only for the very first start of member 1; restart without it.",
                )
            return
        if self.node_id == 1 and not bootstrap:
            raise ValidationError(
                f"member 1 has no Raft state in {self.data_dir}",
                hint="On the very first start of member 1 pass --bootstrap; later restarts omit it. "
                "If this is a restart, check quorum.data_dir.",
            )
        if bootstrap and self.node_id != 1:
            raise ValidationError(
                "--bootstrap is only valid for member 1",
                hint="Members 2..n join from their peers configuration without --bootstrap.",
            )
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"member_id": self.node_id, "created_at": time.time()}))
        os.replace(tmp, marker)

    def _check_dump(self) -> None:
        """Refuse to start on a snapshot that cannot be read. pysyncobj only logs "failed
        to load full dump" and goes on with an empty state and the journal written after
        that snapshot: such a member would answer with nothing before the snapshot and,
        its log being current, could even be elected leader of that empty state."""
        dump = self.data_dir / "raft.dump"
        if not dump.exists():
            return
        import gzip

        # Decompressing the whole stream checks gzip's CRC-32 and length trailer: any
        # changed or missing byte is found in bounded memory, before anything is
        # unpickled (a damaged pickle can ask for gigabytes before it fails).
        try:
            with gzip.open(dump, "rb") as g:
                while g.read(1 << 20):
                    pass
        except Exception as e:
            raise ValidationError(
                f"member {self.node_id}: the Raft snapshot {dump} cannot be read "
                f"({type(e).__name__}: {str(e)[:120]})",
                hint=f"Move {self.data_dir} aside and start the member again: it rejoins "
                "empty and catches up from its peers (member 1 with --bootstrap only when "
                "the whole quorum is lost; then restore a backup with --recover-from).",
            ) from e

    # --- asyncio side ---------------------------------------------------------------

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def on_leadership(self, cb: Callable[[bool], None]) -> None:
        """``cb(is_leader)`` runs on the event loop whenever this member's role changes."""
        self._leader_callbacks.append(cb)

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        """Commit ``cmd`` through Raft and return its result (with ``error`` set when the
        state machine rejected it). Raises Unavailable when no commit happens in time."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[c.CommandResult] = loop.create_future()
        self._pending.append((cmd, fut, time.perf_counter()))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        try:
            return await asyncio.wait_for(fut, self.commit_timeout + 1.0)
        except TimeoutError:
            # pysyncobj never called back (e.g. the leader died mid-commit): the same
            # Unavailable as its own timeout, not an unhandled error (HTTP 500)
            raise Unavailable(
                f"Raft commit not confirmed within {self.commit_timeout + 1.0:.1f}s",
                hint="Retry with the same request id; a majority of quorum members must be up.",
            ) from None

    async def propose_many(self, cmds: list[c.Command]) -> list[c.CommandResult]:
        return list(await asyncio.gather(*(self.propose(cmd) for cmd in cmds)))

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        loop = asyncio.get_running_loop()
        if len(batch) == 1:
            raw = c.encode_command(batch[0][0])
        else:
            raw = c.encode_command(c.Batch(commands=[b[0] for b in batch]))

        def done(result: bytes | None, error: int) -> None:  # pysyncobj thread
            loop.call_soon_threadsafe(self._resolve, batch, result, error)

        try:
            self.sm.apply_command(raw, callback=done)
        except Exception as e:  # queue full and similar
            self._resolve(batch, None, -1, str(e))

    def _resolve(
        self,
        batch: list[tuple[c.Command, asyncio.Future[c.CommandResult], float]],
        raw: bytes | None,
        error: int,
        detail: str = "",
    ) -> None:
        now = time.perf_counter()
        if raw is None or error != FAIL_REASON.SUCCESS:
            err = _fail_reason(error, detail)
            for _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        res = c.decode_result(raw)
        results = res.results if len(batch) > 1 and res.results is not None else [res]
        for (_, fut, t0), r in zip(batch, results, strict=False):
            COMMIT_LATENCY.labels(self._member_label).observe(now - t0)
            if not fut.done():
                fut.set_result(r)

    # --- reads ----------------------------------------------------------------------

    def read(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(state, *args, **kwargs)`` under the apply lock; ``fn`` must copy
        what it keeps."""
        with self.sm._lock:
            return fn(self.sm.state, *args, **kwargs)

    @property
    def revision(self) -> int:
        return self.sm.state.revision

    def snapshot_delta(self) -> bytes:
        return self.read(encode_snapshot)

    def subscribe(self, maxsize: int = 0) -> asyncio.Queue[bytes | None]:
        """A queue that receives the snapshot first, then every delta. ``None`` means
        the state was replaced (dump loaded): drop the mirror and resubscribe. Refused
        (Unavailable) while this member is not in sync with a leader."""
        self.require_caught_up()
        q: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize)
        with self.sm._lock:
            q.put_nowait(self.snapshot_delta())
            self._watchers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[bytes | None]) -> None:
        self._watchers.discard(q)

    def _on_applied(self, state: GlobalState, ch: Changes) -> None:  # pysyncobj thread, lock held
        if self._loop is None or not self._watchers:
            return
        delta = encode_changes(state, ch)
        for q in list(self._watchers):
            self._loop.call_soon_threadsafe(q.put_nowait, delta)

    def _on_reset(self) -> None:
        if self._loop is None:
            return
        for q in list(self._watchers):
            self._loop.call_soon_threadsafe(q.put_nowait, None)

    # --- raft status --------------------------------------------------------------

    def _on_raft_state(self, old: int, new: int) -> None:  # pysyncobj thread
        leader = new == 2  # _RAFT_STATE.LEADER
        RAFT_LEADER.labels(self._member_label).set(1 if leader else 0)
        if self._loop is not None:
            for cb in self._leader_callbacks:
                self._loop.call_soon_threadsafe(cb, leader)

    @property
    def caught_up(self) -> bool:
        """True when this member has synced with a live leader: only then does its
        state reflect the cluster (a member replaying its journal, or cut off from the
        leader, must not be read as current)."""
        return self.syncobj._getLeader() is not None and self.syncobj.isReady()

    def require_caught_up(self) -> None:
        if not self.caught_up:
            raise Unavailable(
                f"quorum member {self.node_id} is not in sync with a leader",
                hint="Retry shortly, or against another quorum member.",
            )

    @property
    def is_leader(self) -> bool:
        return self.syncobj._isLeader()

    @property
    def leader_raft_address(self) -> str | None:
        leader = self.syncobj._getLeader()
        return (
            None
            if leader is None
            else str(leader.address if hasattr(leader, "address") else leader)
        )

    def status(self) -> dict[str, Any]:
        st = self.syncobj.getStatus()
        RAFT_LOG_ENTRIES.labels(self._member_label).set(st.get("log_len", 0))
        members = [{"id": self.node_id, "address": self.bind, "state": _role(st.get("state"))}]
        for pid, addr in sorted(self.peers.items()):
            connected = st.get(f"partner_node_status_server_{addr}", 0) == 2
            members.append(
                {"id": pid, "address": addr, "state": "connected" if connected else "disconnected"}
            )
        return {
            "member_id": self.node_id,
            "leader_address": self.leader_raft_address or "",
            "is_leader": self.is_leader,
            "term": st.get("raft_term", 0),
            "commit_index": st.get("commit_idx", 0),
            "last_applied": st.get("last_applied", 0),
            "log_len": st.get("log_len", 0),
            "revision": self.revision,
            "members": members,
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.syncobj.destroy()


def _role(state: Any) -> str:
    return {0: "follower", 1: "candidate", 2: "leader"}.get(state, str(state))


def _fail_reason(code: int, detail: str = "") -> LatticeError:
    if code == FAIL_REASON.NOT_LEADER or code == FAIL_REASON.MISSING_LEADER:
        return NotLeader(
            "no Raft leader available to commit the request",
            hint="A leader election is probably in progress; retry in a few seconds.",
        )
    return Unavailable(
        f"Raft commit failed ({_FAIL_NAMES.get(code, code)}{': ' + detail if detail else ''})",
        hint="Check `lattice admin raft status`; a majority of quorum members must be up.",
    )


_FAIL_NAMES = {
    FAIL_REASON.QUEUE_FULL: "queue full",
    FAIL_REASON.MISSING_LEADER: "missing leader",
    FAIL_REASON.DISCARDED: "discarded",
    FAIL_REASON.NOT_LEADER: "not leader",
    FAIL_REASON.LEADER_CHANGED: "leader changed",
    FAIL_REASON.REQUEST_DENIED: "request denied",
}
