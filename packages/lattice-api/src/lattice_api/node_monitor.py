"""Heartbeats and agent reports, held in the leader's memory only (never in Raft).

Agents heartbeat the leader with their actual allocations. The monitor turns what it
hears (and what it stops hearing) into quorum commands: an exited allocation becomes
Completed/Failed, a silent node becomes Degraded after ``heartbeat_timeout`` and Down
after a further ``grace_period`` (its allocations are then requeued per policy by the
state machine). A new leader starts every node's clock afresh, so a failover never
marks healthy nodes Down.

Heartbeats carry a sequence number the agent increments for every heartbeat (spec:
"monotonic sequence number — replay detection"): one not above the last accepted from
that node is a replay and refused (StaleRevision, counted in
``lattice_api_heartbeats_rejected_total{reason="replay"}``). Registration starts a
node's sequence afresh (a restarted agent counts from 1 again), and so does a new
leader. Each node may also send at most ``heartbeat_burst`` heartbeats at once,
refilled one per heartbeat interval (spec: "max 1 heartbeat per interval"); more are
refused with RESOURCE_EXHAUSTED (``reason="rate_limited"``). A heartbeat that carries
an allocation's end or a prologue result is not counted: agents send one at once on
every such event, and holding it back would hold back completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from lattice_common import commands as c
from lattice_common.errors import NotLeader, RateLimited, StaleRevision
from lattice_common.types import (
    PHASE_CHECKPOINT_FAILED,
    PHASE_CHECKPOINTED,
    PHASE_PROLOGUE_FAILED,
    PHASE_STAGED,
    AllocationReport,
    AllocationState,
    CheckpointRecord,
    Node,
    NodeState,
)
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum
from prometheus_client import Counter, Histogram

from lattice_api.ratelimit import HeartbeatLimiter

log = logging.getLogger("lattice.api.nodes")

HEARTBEAT_AGE = Histogram(
    "lattice_agent_heartbeat_interval_seconds",
    "Seconds between consecutive heartbeats seen by the leader",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 15, 30, 60),
)
HEARTBEATS_REJECTED = Counter(
    "lattice_api_heartbeats_rejected_total",
    "Heartbeats refused by the leader: a replayed sequence number or over the node's rate",
    ["reason"],
)


FAILED_CHECKPOINTS = Counter(
    "lattice_preemption_failed_checkpoint_total",
    "Checkpoints asked for by preemption or suspend that did not complete (timeout, "
    "unresponsive application, walltime): the allocation ended Failed, not Suspended",
)

WALLTIME_CONFLICTS = Counter(
    "lattice_checkpoint_walltime_conflict_total",
    "Checkpoints in progress when the allocation's walltime expired (usable or not)",
)

_EVENT_PHASES = frozenset(
    {"exited", PHASE_STAGED, PHASE_PROLOGUE_FAILED, PHASE_CHECKPOINTED, PHASE_CHECKPOINT_FAILED}
)


class NodeMonitor:
    def __init__(
        self,
        quorum: Quorum,
        *,
        heartbeat_timeout: float = 30.0,
        grace_period: float = 60.0,
        sensitive_grace_period: float = 300.0,
        borrowed_grace_period: float = 30.0,
        check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_prologue_retries: int = 3,
        heartbeat_interval: float = 10.0,
        heartbeat_burst: int = 0,
        seed_interval: float = 10.0,
    ) -> None:
        self.quorum = quorum
        self.heartbeat_timeout = heartbeat_timeout
        self.grace_period = grace_period
        self.sensitive_grace_period = sensitive_grace_period
        self.borrowed_grace_period = borrowed_grace_period
        self.check_interval = check_interval
        self.clock = clock
        self.max_prologue_retries = max_prologue_retries
        self.last_seen: dict[str, float] = {}
        self.seed_interval = seed_interval
        self._next_seed = 0.0
        self.sequence: dict[str, int] = {}
        # per-node heartbeat limit (rate_limit.heartbeat_burst; 0 = none)
        self.heartbeat_limit = HeartbeatLimiter(heartbeat_interval, heartbeat_burst, clock=clock)
        self._inflight: set[str] = set()
        self._conformance_inflight: set[str] = set()
        self._prologue_inflight: set[tuple[str, str]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="node-monitor")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def on_leadership(self, is_leader: bool) -> None:
        if is_leader:
            now = self.clock()
            ids = self.quorum.read(queries.node_ids)
            self.last_seen = dict.fromkeys(ids, now)
            self.sequence.clear()  # agents may have restarted under another leader

    def registered(self, node_id: str) -> None:
        """A node (re-)registered: its clock and its heartbeat sequence start afresh."""
        self.last_seen[node_id] = self.clock()
        self.sequence.pop(node_id, None)

    async def heartbeat(
        self,
        node_id: str,
        sequence: int,
        reports: list[AllocationReport],
        conformance_fingerprint: str = "",
    ) -> dict[str, object]:
        """Record a heartbeat; returns what the agent should know (re-register?).

        A ``conformance_fingerprint`` that differs from the node's committed
        conformance group is proposed as ReportConformance (the quorum records drift);
        an unchanged one costs nothing."""
        answer, follow_up = self.accept(node_id, sequence, reports, conformance_fingerprint)
        if follow_up is not None:
            await follow_up
        return answer

    def accept(
        self,
        node_id: str,
        sequence: int,
        reports: list[AllocationReport],
        conformance_fingerprint: str = "",
    ) -> tuple[dict[str, object], Coroutine[Any, Any, None] | None]:
        """The part of a heartbeat that needs no commit, done at once: the answer, and
        the commits it calls for as a coroutine to await (None for a Ready node with
        nothing new, the steady state). Raises as :meth:`heartbeat` does. A batch of
        heartbeats (BatchHeartbeat) accepts every one, then awaits their commits
        together."""
        if not self.quorum.is_leader:
            raise NotLeader(
                "this quorum member is not the leader", hint="Retry against the leader."
            )
        now = self.clock()
        prev = self.last_seen.get(node_id)
        if prev is not None:
            HEARTBEAT_AGE.observe(now - prev)
        last = self.sequence.get(node_id)
        if last is not None and sequence <= last:
            HEARTBEATS_REJECTED.labels("replay").inc()
            log.warning(
                "heartbeat of %s refused: sequence %d replayed (last accepted %d)",
                node_id,
                sequence,
                last,
            )
            raise StaleRevision(
                f"heartbeat sequence {sequence} of node {node_id} is a replay: the last "
                f"accepted was {last}",
                details={"node": node_id, "sequence": sequence, "last_accepted": last},
                hint="Every heartbeat carries a higher sequence number; a restarted agent "
                "registers again first.",
            )
        # the limit is for liveness-only heartbeats (spec: at most one per interval);
        # one that carries an allocation's end or prologue result is how completions
        # reach the quorum at once, and is never held back. Only such reports give
        # handle_reports anything to do, so a heartbeat without one skips it.
        events = any(r.phase in _EVENT_PHASES or r.hint_id for r in reports)
        if not events:
            try:
                self.heartbeat_limit.check(node_id)
            except RateLimited:
                HEARTBEATS_REJECTED.labels("rate_limited").inc()
                raise
        self.sequence[node_id] = sequence
        self.last_seen[node_id] = now
        # three fields, not a copy of the node record (this runs for every heartbeat)
        seen = self.quorum.read(queries.node_liveness, node_id)
        if seen is None:
            return {"accepted": False, "reregister": True}, None
        state, disabled, conformance_group = seen
        degraded = state == NodeState.DEGRADED
        if not degraded and state in (NodeState.DOWN, NodeState.UNKNOWN) and not disabled:
            return {"accepted": True, "reregister": True}, None
        drifted = bool(conformance_fingerprint) and conformance_fingerprint != conformance_group
        answer: dict[str, object] = {"accepted": True, "reregister": False}
        if not (degraded or drifted or events):
            return answer, None
        return answer, self._follow_up(
            node_id,
            degraded=degraded,
            fingerprint=conformance_fingerprint if drifted else "",
            reports=reports if events else [],
        )

    async def _follow_up(
        self, node_id: str, *, degraded: bool, fingerprint: str, reports: list[AllocationReport]
    ) -> None:
        """A heartbeat's commits, in order: back to Ready, conformance drift, the
        allocation events it reports."""
        if degraded:
            await self._propose(
                c.SetNodeHealth(node_id=node_id, state=NodeState.READY, now=time.time())
            )
        # checked here, not in accept: a follow-up never awaited leaves no mark behind
        if fingerprint and node_id not in self._conformance_inflight:
            self._conformance_inflight.add(node_id)
            try:
                await self._propose(
                    c.ReportConformance(node_id=node_id, fingerprint=fingerprint, now=time.time())
                )
            finally:
                self._conformance_inflight.discard(node_id)
        if reports:
            await self.handle_reports(node_id, reports)

    async def handle_reports(self, node_id: str, reports: list[AllocationReport]) -> None:
        cmds: list[c.Command] = []
        for r in reports:
            if r.phase in (PHASE_STAGED, PHASE_PROLOGUE_FAILED):
                cmd = self._prologue(node_id, r)
                if cmd is not None:
                    cmds.append(cmd)
                continue
            if r.phase in (PHASE_CHECKPOINTED, PHASE_CHECKPOINT_FAILED):
                ck = self._checkpoint(node_id, r)
                if ck is not None:
                    cmds.append(ck)
                continue
            if r.phase == "running" and r.hint_id:
                hint = self._hint_outcome(node_id, r)
                if hint is not None:
                    cmds.append(hint)
                continue
            if r.phase != "exited" or r.allocation_id in self._inflight:
                continue
            a = self.quorum.read(queries.allocation, r.allocation_id)
            if a is None or a.terminal or a.state == AllocationState.PENDING:
                continue
            if not a.assigned_nodes or a.assigned_nodes[0] != node_id:
                continue  # only the head node's exit ends the allocation
            if a.state == AllocationState.CHECKPOINTING and r.reason == "preempted":
                # preempted without a checkpoint (checkpoint: none): straight back in
                # the queue with its original submit time (Suspended needs a checkpoint)
                cmds.append(
                    c.RequeueAllocation(
                        allocation_id=a.id, reason="preempted", preempted=True, now=time.time()
                    )
                )
                continue
            ok = r.exit_code == 0 and not r.reason
            cmds.append(
                c.UpdateAllocationState(
                    allocation_id=a.id,
                    state=AllocationState.COMPLETED if ok else AllocationState.FAILED,
                    reason=r.reason or ("" if ok else f"exit_code_{r.exit_code}"),
                    exit_code=r.exit_code,
                    started_at=r.started_at,
                    finished_at=r.finished_at,
                    peak_memory_bytes=r.peak_memory_bytes,
                    now=time.time(),
                )
            )
        if not cmds:
            return
        ids = [
            cmd.commands[0].allocation_id if isinstance(cmd, c.Batch) else cmd.allocation_id  # type: ignore[attr-defined]
            for cmd in cmds
            if not isinstance(cmd, c.ReportPrologue)
        ]
        staging = [
            (cmd.allocation_id, cmd.node_id) for cmd in cmds if isinstance(cmd, c.ReportPrologue)
        ]
        self._prologue_inflight.update(staging)
        self._inflight.update(ids)
        try:
            results = await self.quorum.propose_many(cmds)
            # a preemption victim stays Suspended (visible) for one commit, then goes
            # back in the queue; an owner's suspend waits for `lattice resume`
            requeues: list[c.Command] = [
                c.RequeueAllocation(
                    allocation_id=res.allocation.id,
                    reason="preempted",
                    preempted=True,
                    now=time.time(),
                )
                for cmd, res in zip(cmds, results, strict=False)
                if isinstance(cmd, c.RecordCheckpoint)
                and res.error is None
                and res.allocation is not None
                and res.allocation.preempted_by
            ]
            if requeues:
                await self.quorum.propose_many(requeues)
        finally:
            self._inflight.difference_update(ids)
            self._prologue_inflight.difference_update(staging)

    def _hint_outcome(self, node_id: str, r: AllocationReport) -> c.Command | None:
        """A checkpoint broker hint's outcome on a still-running allocation (checkpoint
        and continue); heartbeats repeat it until the hint is no longer outstanding."""
        if r.allocation_id in self._inflight:
            return None
        a = self.quorum.read(queries.allocation, r.allocation_id)
        h = a.checkpoint_hint if a is not None else None
        if (
            a is None
            or h is None
            or h.id != r.hint_id
            or h.done_at is not None
            or a.assigned_nodes[:1] != [node_id]
        ):
            return None
        now = time.time()
        record = (
            CheckpointRecord(
                id=r.checkpoint_id,
                path=r.checkpoint_path,
                size_bytes=r.checkpoint_size_bytes,
                duration_seconds=r.checkpoint_duration_seconds,
                at=now,
            )
            if r.checkpoint_id
            else None
        )
        return c.CompleteCheckpointHint(
            allocation_id=a.id,
            node_id=node_id,
            hint_id=h.id,
            checkpoint=record,
            outcome="ok" if record is not None else (r.reason or "checkpoint_failed"),
            now=now,
        )

    def _checkpoint(self, node_id: str, r: AllocationReport) -> c.Command | None:
        """The head node's checkpoint outcome for a Checkpointing allocation (its
        processes have stopped): Suspended with the record, or Failed. Heartbeats repeat
        it until the allocation leaves the node."""
        if r.allocation_id in self._inflight:
            return None
        a = self.quorum.read(queries.allocation, r.allocation_id)
        if a is None:
            return None
        if (
            a.state == AllocationState.SUSPENDED
            and a.preempted_by
            and r.phase == PHASE_CHECKPOINTED
            and a.last_checkpoint is not None
            and a.last_checkpoint.id == r.checkpoint_id
        ):
            # recorded, but its requeue was lost (e.g. a leader change in between)
            return c.RequeueAllocation(
                allocation_id=a.id, reason="preempted", preempted=True, now=time.time()
            )
        if a.state != AllocationState.CHECKPOINTING or a.assigned_nodes[:1] != [node_id]:
            return None
        now = time.time()
        if r.reason == "walltime_exceeded":
            WALLTIME_CONFLICTS.inc()
        if r.phase == PHASE_CHECKPOINTED:
            return c.RecordCheckpoint(
                allocation_id=a.id,
                node_id=node_id,
                checkpoint=CheckpointRecord(
                    id=r.checkpoint_id,
                    path=r.checkpoint_path,
                    size_bytes=r.checkpoint_size_bytes,
                    duration_seconds=r.checkpoint_duration_seconds,
                    at=r.finished_at or now,
                ),
                now=now,
            )
        FAILED_CHECKPOINTS.inc()
        log.warning("allocation %s: checkpoint failed (%s)", a.id, r.reason)
        return c.UpdateAllocationState(
            allocation_id=a.id,
            state=AllocationState.FAILED,
            reason=r.reason or "checkpoint_failed",
            exit_code=r.exit_code,
            started_at=r.started_at,
            finished_at=r.finished_at,
            peak_memory_bytes=r.peak_memory_bytes,
            now=now,
        )

    def _prologue(self, node_id: str, r: AllocationReport) -> c.ReportPrologue | None:
        """A node's prologue result for a Staging allocation, once per attempt: heartbeats
        repeat it until the state moves on."""
        if (r.allocation_id, node_id) in self._prologue_inflight:
            return None
        a = self.quorum.read(queries.allocation, r.allocation_id)
        if (
            a is None
            or a.state != AllocationState.STAGING
            or node_id not in a.assigned_nodes
            or node_id in a.staged_nodes
            or r.attempt != a.prologue_failures
        ):
            return None
        return c.ReportPrologue(
            allocation_id=a.id,
            node_id=node_id,
            ok=r.phase == PHASE_STAGED,
            reason=r.reason,
            attempt=r.attempt,
            image_digest=r.image_digest,
            max_retries=self.max_prologue_retries,
            now=time.time(),
        )

    async def _propose(self, cmd: c.Command) -> None:
        try:
            res = await self.quorum.propose(cmd)
            if res.error:
                log.info("node monitor command rejected: %s", res.error.get("message"))
        except Exception as e:
            log.warning("node monitor proposal failed: %s", e)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                if self.quorum.is_leader:
                    await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("node monitor check failed")

    async def check(self) -> None:
        """Turn silent nodes Degraded, then Down. Reads only the nodes silent longer than
        the heartbeat timeout (every change needs that), not all of them: at 10,000
        nodes a read of every node held the apply lock for ~4 ms each second. Nodes this
        monitor has not heard of (registered at another member) are picked up by a read
        of the node ids every ``seed_interval``; their silence counts from then."""
        now = self.clock()
        if now >= self._next_seed:
            self._next_seed = now + self.seed_interval
            for node_id in self.quorum.read(queries.node_ids):
                self.last_seen.setdefault(node_id, now)
        timeout = self.heartbeat_timeout
        silent_ids = [i for i, seen in self.last_seen.items() if now - seen > timeout]
        if not silent_ids:
            return
        nodes = self.quorum.read(queries.each_node_of, silent_ids, _health_view)
        graces = {
            "standard": self.grace_period,
            "sensitive": self.sensitive_grace_period,
            "borrowed": self.borrowed_grace_period,
        }
        for node_id, state, kind in nodes:
            silent = now - self.last_seen[node_id]
            target = health_after_silence(
                state, silent, timeout=self.heartbeat_timeout, grace=graces[kind]
            )
            if target is not None:
                await self._propose(
                    c.SetNodeHealth(
                        node_id=node_id,
                        state=target,
                        reason=f"no heartbeat for {silent:.0f}s",
                        now=time.time(),
                    )
                )


def _health_view(n: Node) -> tuple[str, NodeState, str]:
    return n.id, n.state, grace_kind(n)


def grace_kind(n: Node) -> str:
    """Which Degraded -> Down grace period applies (Node Lifecycle table): sensitive
    (claimed) nodes wait longest, borrowed nodes (held by another vCluster than their
    home) shortest, so their home vCluster gets them back quickly."""
    if n.claimed_by:
        return "sensitive"
    if n.owner and n.home_vcluster and n.owner_vcluster not in ("", n.home_vcluster):
        return "borrowed"
    return "standard"


def health_after_silence(
    state: NodeState, silent: float, *, timeout: float, grace: float
) -> NodeState | None:
    """Ready -> Degraded after ``timeout`` without a heartbeat; Degraded (and drained
    or draining nodes) -> Down after ``timeout + grace``. None: no change."""
    if silent > timeout + grace and state in (
        NodeState.DEGRADED,
        NodeState.DRAINING,
        NodeState.DRAINED,
    ):
        return NodeState.DOWN
    if silent > timeout and state == NodeState.READY:
        return NodeState.DEGRADED
    return None
