"""Accounting events for Waldur, and the pure functions that derive them from quorum state.

Why this module exists: Lattice pushes what happened (spec: Accounting via Waldur,
"Accounting Events") and Waldur bills it. Events come from two places that must agree:

* the live stream of GlobalState changes (a previous and a current record of an
  allocation or a node: :func:`allocation_events`, :func:`node_events`,
  :class:`EventDeriver` over :class:`~lattice_common.watch.StateDelta` messages);
* the history of allocations over a time range (``lattice admin accounting reconcile
  --since --until``: :func:`reconcile_events`), used to regenerate what was dropped.

Every event has a deterministic ``event_id`` computed from what identifies the
happening (the allocation and its start time, the node and its claim time), never from
when it was observed: a replay after a crash, a re-derivation from a snapshot and a
reconcile of the same range produce the same ids, and Waldur (which receives the id as
the order's and the invoice item's ``backend_id``) counts each happening once.

Events derived here:

========================  ==============================================================
``allocation.started``    the allocation enters Running (each run of a requeued one)
``allocation.completed``  the allocation reaches a terminal state
``allocation.checkpointed`` it leaves Checkpointing (the checkpoint was written)
``node.claimed``          a sensitive node gets a claiming user
``node.released``         that claim ends
========================  ==============================================================
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping

import msgspec
from lattice_common import ledger
from lattice_common.types import Allocation, AllocationState, Node
from lattice_common.watch import StateDelta

__all__ = [
    "AccountingEvent",
    "EventDeriver",
    "EventType",
    "allocation_events",
    "decode_event",
    "encode_event",
    "event_id",
    "node_events",
    "reconcile_events",
]


class EventType(enum.StrEnum):
    ALLOCATION_STARTED = "allocation.started"
    ALLOCATION_COMPLETED = "allocation.completed"
    ALLOCATION_CHECKPOINTED = "allocation.checkpointed"
    NODE_CLAIMED = "node.claimed"
    NODE_RELEASED = "node.released"


class AccountingEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One happening Waldur bills. Times are epoch seconds; ``timestamp`` is when it
    happened (start, end, checkpoint or claim/release time). ``revision`` is the
    GlobalState revision it was derived from (0 for reconciled events): it lets the
    service know how far its durable cursor may advance."""

    event_id: str
    type: EventType
    timestamp: float
    tenant: str = ""
    project: str = ""
    user: str = ""
    vcluster: str = ""
    allocation_id: str = ""
    nodes: tuple[str, ...] = ()
    gpus: int = 0
    gpu_type: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    estimated_duration_seconds: int = 0
    duration_seconds: float | None = None
    node_hours: float | None = None
    gpu_hours: float | None = None
    exit_status: int | None = None
    state: str = ""
    reason: str = ""
    wipe_confirmed: bool | None = None
    revision: int = 0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(AccountingEvent)


def encode_event(e: AccountingEvent) -> bytes:
    return _enc.encode(e)


def decode_event(raw: bytes) -> AccountingEvent:
    return _dec.decode(raw)


def event_id(kind: EventType, *key: object) -> str:
    """A stable id: sha256 over the event type and what identifies the happening.
    Floats go through ``repr`` (shortest round-trip form), so the same record always
    gives the same text."""
    text = "|".join([kind.value, *(repr(k) if isinstance(k, float) else str(k) for k in key)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# --- allocations --------------------------------------------------------------------


def _gpu_type(a: Allocation, nodes: Mapping[str, Node]) -> str:
    for nid in a.assigned_nodes:
        n = nodes.get(nid)
        if n is not None and n.capabilities.gpu_type:
            return n.capabilities.gpu_type
    return a.spec.constraints.gpu_type


def _base(a: Allocation, nodes: Mapping[str, Node], node_gpus: Mapping[str, int]) -> dict:
    _n, gpus = ledger.node_and_gpu_count(a, node_gpus)
    return {
        "tenant": a.spec.tenant,
        "project": a.spec.project,
        "user": a.spec.user,
        "vcluster": a.spec.vcluster,
        "allocation_id": a.id,
        "nodes": tuple(dict.fromkeys(a.assigned_nodes)),
        "gpus": gpus,
        "gpu_type": _gpu_type(a, nodes),
        "revision": a.revision,
    }


def started_event(
    a: Allocation, nodes: Mapping[str, Node], node_gpus: Mapping[str, int]
) -> AccountingEvent:
    assert a.started_at is not None
    return AccountingEvent(
        event_id=event_id(EventType.ALLOCATION_STARTED, a.id, *_run_key(a)),
        type=EventType.ALLOCATION_STARTED,
        timestamp=a.started_at,
        started_at=a.started_at,
        estimated_duration_seconds=a.spec.walltime_seconds,
        **_base(a, nodes, node_gpus),
    )


def completed_event(
    a: Allocation, nodes: Mapping[str, Node], node_gpus: Mapping[str, int]
) -> AccountingEvent:
    """Usage of the allocation's last run: (end - start) x nodes, x GPUs (the internal
    ledger's formula, spec: Internal Budget Ledger). Never started: zero usage."""
    ended = a.finished_at if a.finished_at is not None else a.started_at or a.submitted_at
    base = _base(a, nodes, node_gpus)
    secs = max(0.0, ended - a.started_at) if a.started_at is not None else 0.0
    hours = secs / ledger.SECONDS_PER_HOUR
    return AccountingEvent(
        event_id=event_id(EventType.ALLOCATION_COMPLETED, a.id),
        type=EventType.ALLOCATION_COMPLETED,
        timestamp=ended,
        started_at=a.started_at,
        ended_at=ended,
        duration_seconds=secs,
        node_hours=hours * len(base["nodes"]),
        gpu_hours=hours * base["gpus"] if base["nodes"] else 0.0,
        exit_status=a.exit_code,
        state=a.state.value,
        reason=a.reason,
        **base,
    )


def checkpointed_event(
    a: Allocation, nodes: Mapping[str, Node], node_gpus: Mapping[str, int], now: float
) -> AccountingEvent:
    began = a.checkpoint_hint_at
    return AccountingEvent(
        event_id=event_id(
            EventType.ALLOCATION_CHECKPOINTED, a.id, a.preempted_count, float(began or 0.0)
        ),
        type=EventType.ALLOCATION_CHECKPOINTED,
        timestamp=now,
        started_at=a.started_at,
        duration_seconds=max(0.0, now - began) if began is not None else None,
        state=a.state.value,
        reason=a.reason,
        **_base(a, nodes, node_gpus),
    )


_RUN_STATES = frozenset(
    {AllocationState.RUNNING, AllocationState.CHECKPOINTING, AllocationState.SUSPENDED}
)
_BEFORE_RUN = frozenset({AllocationState.PENDING, AllocationState.STAGING})


def _run_key(a: Allocation) -> tuple[int, int]:
    """Which run of the allocation this is: each requeue and each preemption starts a
    new one. Not ``started_at``: the end of a run may correct it to when the process
    really started, and the started event's id must not change with it."""
    return a.requeue_count, a.preempted_count


def _new_run(prev: Allocation | None, cur: Allocation) -> bool:
    """Whether ``cur`` shows a run that ``prev`` did not."""
    if cur.state in _RUN_STATES:
        return prev is None or prev.state in _BEFORE_RUN or _run_key(prev) != _run_key(cur)
    # first seen already ended (a snapshot after a restart): its last run counts
    return cur.terminal and prev is None


def allocation_events(
    prev: Allocation | None,
    cur: Allocation,
    *,
    nodes: Mapping[str, Node] | None = None,
    node_gpus: Mapping[str, int] | None = None,
    now: float,
) -> list[AccountingEvent]:
    """The events one change of an allocation record means (``prev`` None: first seen).
    ``nodes`` is the inventory (GPU counts and types; ``node_gpus``, its GPU counts, is
    computed from it when not given); ``now`` stamps the checkpoint event, the one
    happening the record has no time for."""
    nodes = nodes or {}
    gpus = ledger.node_gpu_counts(nodes.values()) if node_gpus is None else node_gpus
    out: list[AccountingEvent] = []
    if cur.started_at is not None and _new_run(prev, cur):
        out.append(started_event(cur, nodes, gpus))
    if (
        prev is not None
        and prev.state == AllocationState.CHECKPOINTING
        and cur.state != AllocationState.CHECKPOINTING
        and cur.state != AllocationState.FAILED
    ):
        out.append(checkpointed_event(cur, nodes, gpus, now))
    if cur.terminal and (prev is None or not prev.terminal):
        out.append(completed_event(cur, nodes, gpus))
    return out


# --- nodes --------------------------------------------------------------------------


def node_events(
    prev: Node | None, cur: Node, *, now: float, claim_tenant: str = ""
) -> list[AccountingEvent]:
    """node.claimed / node.released from one change of a node record (sensitive claims:
    idle claimed time is billable, spec: Sensitive Accounting). ``claim_tenant``: the
    tenant the claim was made for (an idle claimed node has no owner to name it)."""
    out: list[AccountingEvent] = []
    prev_by = prev.claimed_by if prev is not None else ""
    prev_at = prev.claimed_at if prev is not None else None
    gpus = max(0, cur.capabilities.gpu_count)
    if prev_by and (cur.claimed_by != prev_by or cur.claimed_at != prev_at):
        began = prev_at if prev_at is not None else now
        hours = max(0.0, now - began) / ledger.SECONDS_PER_HOUR
        out.append(
            AccountingEvent(
                event_id=event_id(EventType.NODE_RELEASED, cur.id, prev_by, float(began)),
                type=EventType.NODE_RELEASED,
                timestamp=now,
                tenant=claim_tenant or (prev.owner_tenant if prev is not None else ""),
                user=prev_by,
                nodes=(cur.id,),
                gpus=gpus,
                gpu_type=cur.capabilities.gpu_type,
                started_at=began,
                ended_at=now,
                duration_seconds=max(0.0, now - began),
                node_hours=hours,
                gpu_hours=hours * gpus,
                # the node leaves the claim only after its wipe (spec: sensitive
                # workloads); a node that went Down while claimed has not been wiped
                wipe_confirmed=cur.state.value not in ("Down", "Failed"),
                revision=cur.revision,
            )
        )
    if cur.claimed_by and (cur.claimed_by != prev_by or cur.claimed_at != prev_at):
        at = cur.claimed_at if cur.claimed_at is not None else now
        out.append(
            AccountingEvent(
                event_id=event_id(EventType.NODE_CLAIMED, cur.id, cur.claimed_by, float(at)),
                type=EventType.NODE_CLAIMED,
                timestamp=at,
                tenant=cur.owner_tenant,
                user=cur.claimed_by,
                nodes=(cur.id,),
                gpus=gpus,
                gpu_type=cur.capabilities.gpu_type,
                started_at=at,
                revision=cur.revision,
            )
        )
    return out


# --- the live stream ----------------------------------------------------------------


class EventDeriver:
    """Turns the watch-state stream (snapshot, then deltas) into events.

    ``since_revision`` is the durable cursor: on a snapshot, records changed after it
    are treated as new (their events regenerated, with the same ids, so whatever was
    lost in memory by a crash comes back and Waldur ignores what it already has);
    records at or before it are the baseline. Releases of claims that ended while the
    service was away cannot be seen in a snapshot: reconcile covers allocations, and
    the claim history lives in the sensitive audit log."""

    def __init__(self, since_revision: int = 0) -> None:
        self.since_revision = since_revision
        self.allocations: dict[str, Allocation] = {}
        self.nodes: dict[str, Node] = {}
        self.node_gpus: dict[str, int] = {}
        self.claim_tenants: dict[str, str] = {}  # node id -> tenant of its claim
        self.revision = 0

    def apply(self, delta: StateDelta, *, now: float) -> list[AccountingEvent]:
        out: list[AccountingEvent] = []
        if delta.snapshot:
            old_allocs, old_nodes = self.allocations, self.nodes
            self.allocations, self.nodes = {}, {}
            for n in delta.nodes:
                self.nodes[n.id] = n
            self.node_gpus = ledger.node_gpu_counts(self.nodes.values())
            for n in delta.nodes:
                prev = old_nodes.get(n.id)
                if prev is None and n.revision <= self.since_revision:
                    self._track_claim(n)
                    continue
                out += self._node(prev, n, now)
            for a in delta.allocations:
                self.allocations[a.id] = a
                prev = old_allocs.get(a.id)
                if prev is None and a.revision <= self.since_revision:
                    continue
                out += self._allocation(prev, a, now)
        else:
            for n in delta.nodes:
                out += self._node(self.nodes.get(n.id), n, now)
                self.nodes[n.id] = n
                self.node_gpus[n.id] = max(0, int(n.capabilities.gpu_count))
            for a in delta.allocations:
                out += self._allocation(self.allocations.get(a.id), a, now)
                self.allocations[a.id] = a
        self.revision = delta.revision if delta.snapshot else max(self.revision, delta.revision)
        # one entry may hold several happenings (a node handed from the job that ended to
        # the next one: lattice_quorum.handlers.handoff); a delta lists its records in no
        # particular order, Waldur gets them in the order they happened
        out.sort(key=lambda e: e.timestamp)
        return out

    def _track_claim(self, n: Node) -> None:
        if not n.claimed_by:
            self.claim_tenants.pop(n.id, None)
        elif n.owner_tenant:
            self.claim_tenants[n.id] = n.owner_tenant
        elif n.owner and n.owner in self.allocations:
            self.claim_tenants[n.id] = self.allocations[n.owner].spec.tenant

    def _node(self, prev: Node | None, cur: Node, now: float) -> list[AccountingEvent]:
        out = node_events(prev, cur, now=now, claim_tenant=self.claim_tenants.get(cur.id, ""))
        self._track_claim(cur)
        return out

    def _allocation(
        self, prev: Allocation | None, cur: Allocation, now: float
    ) -> list[AccountingEvent]:
        return allocation_events(prev, cur, nodes=self.nodes, node_gpus=self.node_gpus, now=now)


# --- reconcile ----------------------------------------------------------------------


def reconcile_events(
    allocations: Iterable[Allocation],
    *,
    since: float,
    until: float,
    nodes: Mapping[str, Node] | None = None,
) -> list[AccountingEvent]:
    """Compensating events for ``[since, until)`` from a history of allocations (spec:
    "reads allocation history from the quorum and generates compensating events"):
    ``allocation.started`` for each run that started in the range and
    ``allocation.completed`` for each allocation that ended in it, ordered by time.
    The ids equal those of the live stream, so Waldur counts nothing twice. Only the
    last run of a requeued allocation is in its record; checkpoints are not recorded."""
    if until <= since:
        raise ValueError("until must be after since")
    nodes = nodes or {}
    gpus = ledger.node_gpu_counts(nodes.values())
    out: list[AccountingEvent] = []
    for a in allocations:
        if a.started_at is not None and since <= a.started_at < until:
            out.append(msgspec.structs.replace(started_event(a, nodes, gpus), revision=0))
        if a.terminal and a.finished_at is not None and since <= a.finished_at < until:
            out.append(msgspec.structs.replace(completed_event(a, nodes, gpus), revision=0))
    out.sort(key=lambda e: (e.timestamp, e.type != EventType.ALLOCATION_STARTED, e.event_id))
    return out
