"""The chaos history checker: pure functions over a recorded history.

A history is what a chaos run saw from the outside (lattice_test_harness-free plain data):

* ``acks``: every submission the API acknowledged (201), with its request id;
* ``cancels``: every cancellation the API acknowledged (2xx);
* ``observations``: allocation states polled from the members' REST API, each with the
  allocation's own revision (the Raft revision that last changed it);
* ``node_observations``: node states and owners polled the same way;
* ``runs``: what actually ran, from the records the workloads write on the node they run
  on (start, periodic ticks, end; wall-clock times);
* ``final``: the allocations as every member holds them at the end, after the faults are
  healed and the members have caught up.

``check(history)`` returns a :class:`Report`; nothing here does I/O, so every rule is
property-tested on synthetic histories (test_chaos_checker.py).

The legal allocation moves come from ``lattice_common.state_machine`` (the table the quorum
itself enforces). Polling can miss intermediate states, so an observed step ``a -> b`` is
legal when ``b`` is reachable from ``a`` in that table; observations are ordered by the
allocation's revision, not by when they were polled, so a stale read from a lagging
follower is not mistaken for a step back.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import cache

from lattice_common.state_machine import ALLOCATION_TRANSITIONS
from lattice_common.types import AllocationState

TERMINAL = frozenset(s.value for s in AllocationState if s.terminal)
# states in which an allocation holds its assigned nodes
HOLDING = frozenset({"Staging", "Running", "Checkpointing"})

__all__ = [
    "Ack",
    "CancelAck",
    "FinalAlloc",
    "History",
    "NodeObservation",
    "Observation",
    "Report",
    "Run",
    "Violation",
    "check",
    "reachable",
]


@dataclass(frozen=True)
class Ack:
    request_id: str
    alloc_id: str
    at: float


@dataclass(frozen=True)
class CancelAck:
    alloc_id: str
    at: float


@dataclass(frozen=True)
class Observation:
    """One allocation as one member answered at ``at``."""

    at: float
    member: int
    alloc_id: str
    revision: int
    state: str
    nodes: tuple[str, ...]
    request_id: str = ""


@dataclass(frozen=True)
class NodeObservation:
    at: float
    node_id: str
    state: str
    owner: str


@dataclass(frozen=True)
class Run:
    """One process of an allocation on a node: from its start record to the last record
    it wrote (``ended``: it wrote its end record)."""

    alloc_id: str
    node_id: str
    pid: int
    start: float
    last_seen: float
    ended: bool = False


@dataclass(frozen=True)
class FinalAlloc:
    alloc_id: str
    request_id: str
    state: str
    nodes: tuple[str, ...]
    revision: int
    started_at: float | None = None
    walltime_seconds: float = 0.0


@dataclass
class History:
    acks: list[Ack] = field(default_factory=list)
    cancels: list[CancelAck] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    node_observations: list[NodeObservation] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    # member id -> that member's allocations at the end (the leader's is the reference)
    final: dict[int, list[FinalAlloc]] = field(default_factory=dict)
    leader: int = 0
    ended_at: float = 0.0
    # nodes Ready and free at the end: a Pending allocation with such a node is stuck
    idle_nodes_at_end: int = 0
    # how long a process may outlive its allocation's move off a node (SIGTERM, grace,
    # SIGKILL) plus the spacing of the workloads' ticks
    overlap_tolerance: float = 3.0


@dataclass(frozen=True)
class Violation:
    kind: str
    alloc_id: str
    detail: str


@dataclass
class Report:
    violations: list[Violation]
    excused: list[Violation]
    counts: dict[str, int]

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_kind(self, kind: str) -> list[Violation]:
        return [v for v in self.violations if v.kind == kind]

    def text(self) -> str:
        lines = ["== chaos history check: " + ("PASS" if self.ok else "FAIL")]
        for k, n in sorted(self.counts.items()):
            lines.append(f"  {k}: {n}")
        kinds = sorted({v.kind for v in self.violations})
        for k in kinds:
            vs = self.by_kind(k)
            lines.append(f"-- {k}: {len(vs)}")
            lines.extend(f"   {v.alloc_id}: {v.detail}" for v in vs[:20])
            if len(vs) > 20:
                lines.append(f"   ... and {len(vs) - 20} more")
        if self.excused:
            lines.append(
                f"-- excused by a node failure (spec: requeue on node loss): {len(self.excused)}"
            )
            lines.extend(f"   {v.alloc_id}: {v.detail}" for v in self.excused[:10])
        return "\n".join(lines)

    def summary(self) -> dict[str, object]:
        per_kind: dict[str, int] = defaultdict(int)
        for v in self.violations:
            per_kind[v.kind] += 1
        return {
            "ok": self.ok,
            "counts": dict(self.counts),
            "violations": dict(per_kind),
            "excused": len(self.excused),
            "first_violations": [asdict(v) for v in self.violations[:50]],
        }

    def json(self) -> str:
        return json.dumps(self.summary(), sort_keys=True)


# --- the state machine ------------------------------------------------------------------


@cache
def reachable(a: str, b: str) -> bool:
    """``b`` can follow ``a`` through one or more legal moves (or is ``a``)."""
    if a == b:
        return True
    table = {s.value: {t.value for t in ts} for s, ts in ALLOCATION_TRANSITIONS.items()}
    if a not in table or b not in table:
        return False
    seen, todo = {a}, [a]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt == b:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


# --- the rules --------------------------------------------------------------------------


def _reference(h: History) -> list[FinalAlloc]:
    if h.leader in h.final:
        return h.final[h.leader]
    return next(iter(h.final.values()), [])


def lost_and_duplicated(h: History) -> list[Violation]:
    """Every acknowledged submission exists exactly once, under the id it was acked with."""
    out: list[Violation] = []
    ref = _reference(h)
    by_id = {a.alloc_id: a for a in ref}
    per_rid: dict[str, set[str]] = defaultdict(set)
    for a in ref:
        if a.request_id:
            per_rid[a.request_id].add(a.alloc_id)
    # an allocation seen at any time during the run counts too: one that existed twice
    # and was later merged away still was a duplicate
    for o in h.observations:
        if o.request_id:
            per_rid[o.request_id].add(o.alloc_id)
    acked_ids: dict[str, set[str]] = defaultdict(set)
    for ack in h.acks:
        acked_ids[ack.request_id].add(ack.alloc_id)
    for rid, ids in sorted(acked_ids.items()):
        if len(ids) > 1:
            out.append(
                Violation("duplicate", sorted(ids)[0], f"request {rid} acked as {sorted(ids)}")
            )
        for aid in sorted(ids):
            if aid not in by_id:
                out.append(
                    Violation(
                        "lost_ack", aid, f"request {rid} acknowledged, not in the final state"
                    )
                )
            elif by_id[aid].request_id != rid:
                out.append(
                    Violation("lost_ack", aid, f"acked for {rid}, holds {by_id[aid].request_id!r}")
                )
    for rid, ids in sorted(per_rid.items()):
        if len(ids) > 1:
            out.append(
                Violation("duplicate", sorted(ids)[0], f"request {rid} exists as {sorted(ids)}")
            )
    return out


def double_ownership(h: History) -> list[Violation]:
    """No node held by two allocations in one consistent view (one member's answer at
    one time), and no node with two allocations' processes alive at once."""
    out: list[Violation] = []
    views: dict[tuple[float, int], list[Observation]] = defaultdict(list)
    for o in h.observations:
        views[(o.at, o.member)].append(o)
    seen: set[tuple[str, frozenset[str]]] = set()
    for (at, member), obs in sorted(views.items()):
        holders: dict[str, set[str]] = defaultdict(set)
        for o in obs:
            if o.state in HOLDING:
                for n in o.nodes:
                    holders[n].add(o.alloc_id)
        for node, ids in holders.items():
            key = (node, frozenset(ids))
            if len(ids) > 1 and key not in seen:
                seen.add(key)
                out.append(
                    Violation(
                        "double_ownership",
                        sorted(ids)[0],
                        f"node {node} held by {sorted(ids)} (member {member} at {at:.2f})",
                    )
                )
    per_node: dict[str, list[Run]] = defaultdict(list)
    for r in h.runs:
        per_node[r.node_id].append(r)
    for node, runs in per_node.items():
        runs.sort(key=lambda r: r.start)
        for i, a in enumerate(runs):
            for b in runs[i + 1 :]:
                if b.start >= a.last_seen:
                    break
                overlap = min(a.last_seen, b.last_seen) - b.start
                if a.alloc_id != b.alloc_id and overlap > h.overlap_tolerance:
                    out.append(
                        Violation(
                            "double_ownership",
                            a.alloc_id,
                            f"node {node} ran {a.alloc_id} (pid {a.pid}) and {b.alloc_id} "
                            f"(pid {b.pid}) together for {overlap:.1f}s",
                        )
                    )
    return out


def _down_between(h: History, node: str, t0: float, t1: float) -> bool:
    return any(
        n.node_id == node and n.state in ("Down", "Degraded") and t0 <= n.at <= t1
        for n in h.node_observations
    )


def overlapping_runs(h: History) -> tuple[list[Violation], list[Violation]]:
    """No allocation ran on two node sets at once. An overlap is excused when the earlier
    run's node was seen Degraded or Down before the later run started: the quorum
    declared that node lost and requeued its work, as the failure-mode table says,
    while the process on it kept going (workloads outlive their agent)."""
    bad: list[Violation] = []
    excused: list[Violation] = []
    per_alloc: dict[str, list[Run]] = defaultdict(list)
    for r in h.runs:
        per_alloc[r.alloc_id].append(r)
    for aid, runs in per_alloc.items():
        runs.sort(key=lambda r: r.start)
        for i, a in enumerate(runs):
            for b in runs[i + 1 :]:
                if a.node_id == b.node_id:
                    continue
                overlap = min(a.last_seen, b.last_seen) - max(a.start, b.start)
                if overlap <= h.overlap_tolerance:
                    continue
                v = Violation(
                    "overlapping_runs",
                    aid,
                    f"ran on {a.node_id} (pid {a.pid}, {a.start:.2f}..{a.last_seen:.2f}) and on "
                    f"{b.node_id} (pid {b.pid}, {b.start:.2f}..{b.last_seen:.2f}) together "
                    f"for {overlap:.1f}s",
                )
                if _down_between(h, a.node_id, a.start, b.start):
                    excused.append(v)
                else:
                    bad.append(v)
    return bad, excused


def illegal_transitions(h: History) -> list[Violation]:
    """Each allocation's states, in revision order, follow the transition table; one
    revision never shows two different states (members diverging)."""
    out: list[Violation] = []
    per_alloc: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for o in h.observations:
        per_alloc[o.alloc_id][o.revision].add(o.state)
    for members in h.final.values():
        for f in members:
            per_alloc[f.alloc_id][f.revision].add(f.state)
    for aid, revs in sorted(per_alloc.items()):
        prev: tuple[int, str] | None = None
        for rev in sorted(revs):
            states = revs[rev]
            if len(states) > 1:
                out.append(
                    Violation("divergent_state", aid, f"revision {rev} seen as {sorted(states)}")
                )
                prev = None
                continue
            (state,) = states
            if prev is not None and not reachable(prev[1], state):
                out.append(
                    Violation(
                        "illegal_transition",
                        aid,
                        f"{prev[1]} (rev {prev[0]}) -> {state} (rev {rev})",
                    )
                )
            prev = (rev, state)
    return out


def stuck(h: History) -> list[Violation]:
    """At the end every allocation is terminal, or still legitimately waiting: Pending
    with no free node, or running within its walltime."""
    out: list[Violation] = []
    for a in _reference(h):
        if a.state in TERMINAL:
            continue
        if a.state == "Pending":
            if h.idle_nodes_at_end > 0:
                out.append(
                    Violation(
                        "stuck", a.alloc_id, f"Pending while {h.idle_nodes_at_end} nodes are idle"
                    )
                )
            continue
        within_walltime = (
            a.started_at is not None
            and a.started_at + a.walltime_seconds + h.overlap_tolerance * 10 > h.ended_at
        )
        if a.state in ("Running", "Staging", "Checkpointing") and within_walltime:
            continue
        out.append(Violation("stuck", a.alloc_id, f"{a.state} at the end (nodes {list(a.nodes)})"))
    return out


def cancels_held(h: History) -> list[Violation]:
    """An acknowledged cancellation ends the allocation Cancelled."""
    ref = {a.alloc_id: a for a in _reference(h)}
    out = []
    for c in h.cancels:
        a = ref.get(c.alloc_id)
        if a is not None and a.state != "Cancelled":
            out.append(
                Violation("cancel_lost", c.alloc_id, f"cancel acknowledged, ended {a.state}")
            )
    return out


def members_agree(h: History) -> list[Violation]:
    """After healing and catching up, every member holds the leader's allocations."""
    out: list[Violation] = []
    ref = {a.alloc_id: (a.state, a.revision) for a in _reference(h)}
    for member, allocs in sorted(h.final.items()):
        mine = {a.alloc_id: (a.state, a.revision) for a in allocs}
        missing = sorted(set(ref) - set(mine))
        extra = sorted(set(mine) - set(ref))
        differ = sorted(k for k in set(ref) & set(mine) if ref[k] != mine[k])
        if missing or extra or differ:
            out.append(
                Violation(
                    "divergent_member",
                    (missing + extra + differ + ["-"])[0],
                    f"member {member} vs leader {h.leader}: {len(missing)} missing, "
                    f"{len(extra)} extra, {len(differ)} differ",
                )
            )
    return out


def check(h: History) -> Report:
    violations: list[Violation] = []
    violations += lost_and_duplicated(h)
    violations += double_ownership(h)
    overlapping, excused = overlapping_runs(h)
    violations += overlapping
    violations += illegal_transitions(h)
    violations += stuck(h)
    violations += cancels_held(h)
    violations += members_agree(h)
    ref = _reference(h)
    counts = {
        "acknowledged_submissions": len(h.acks),
        "acknowledged_cancels": len(h.cancels),
        "allocations_final": len(ref),
        "terminal_final": sum(1 for a in ref if a.state in TERMINAL),
        "observations": len(h.observations),
        "runs": len(h.runs),
        "allocations_run_more_than_once": sum(1 for n in _count_by(h.runs).values() if n > 1),
    }
    return Report(violations, excused, counts)


def _count_by(runs: list[Run]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for r in runs:
        out[r.alloc_id] += 1
    return out
