"""GreedyTopologyAwareBackfill: the HPC solver of the specification's Scheduling Algorithm.

Pure (no clock, no I/O): the caller passes ``now``, the pending queue, the nodes, the
allocations holding nodes, and the cost function as a plain callable (``score``), so
this module does not depend on how f1..f9 are computed.

1. Sort pending allocations by ``score`` descending (ties: preemption class
   descending, original submit time, id).
2. For each, in that order:

   a. hard tenant quotas (``max_nodes``, ``max_concurrent_allocations``), counting the
      allocations holding nodes and those placed earlier in this cycle (as
      ``placement.plan_cycle``);
   b. **filter**: nodes Ready, unowned, enabled, whose home vCluster is "" or this one,
      meeting every hard constraint (``gpu_type``, ``gpu_count``, ``features``,
      ``memory_gb``, ``require_unified_memory``; CXL memory counts towards
      ``memory_gb`` only with ``allow_cxl_memory``). Matching is done once per
      capability *signature*, not per node;
   c. **select** exactly ``spec.nodes`` of them: packed into the fewest dragonfly groups
      (one group whenever one holds the job; otherwise the minimum number of groups,
      preferring a run of adjacent groups), then from the largest conformance group
      (hard with ``require_conformance``: a single conformance group or nothing).
      ``topology: "tight"`` makes the packing hard: the job waits until it can be
      placed in as few groups as the idle cluster would allow it (the *ideal span*)
      instead of spreading over more. ``topology: "any"`` relaxes packing: the largest
      conformance group first, group span second;
   Nodes in the allocation's ``excluded_nodes`` (its prologue failed there) are
   withheld from the free nodes while it is considered;
   d. if selected: a proposal; otherwise a pending reason and, for one of the first
      ``backfill_depth`` allocations blocked for capacity, a **reservation**.

Backfill rule: *depth-bounded conservative backfill*. Each of the first
``backfill_depth`` blocked allocations (in score order) gets a reservation: the
earliest time its selection rule (c) can be met with nodes available by then, and
the node set, computed from the expected end of the allocations holding nodes
(``started_at + walltime_seconds``; never for unbounded ones or for nodes that are not
Ready), of the proposals made earlier in the cycle, and of the earlier reservations
(a reserved node counts as busy until that reservation's end). A lower-scored
allocation may start now only on free nodes AND, for every reservation whose start
is before the allocation's own expected end, not on any node of that reservation
(an allocation without walltime never ends, so it avoids every reserved node). So
none of the reserved allocations is delayed. ``backfill_depth=1`` is EASY backfill
(only the top blocked allocation is protected); ``0`` turns reservations off (plain
greedy first fit, the foundation's behaviour); allocations blocked beyond the depth
get no reservation and no protection.

Hard filter: :func:`lattice_scheduler.filters.node_satisfies` (also used by preemption,
the reasons of a cycle with nothing free and RM-Replay's baselines). Its constraint
flags (``require_unified_memory``, ``require_conformance``, ``prefer_same_numa``, ...)
live in ``constraints.features`` and are not node features; see :mod:`filters`.

Power budget: optional ``power_headroom_kw`` (what the cycle may add) with per-node
draws ``node_power_kw``; a selection that would exceed it waits with
"waiting for power budget headroom" (no reservation).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Literal, NamedTuple

import msgspec
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationSpec,
    AllocationState,
    Node,
    NodeState,
    Tenant,
)

from lattice_scheduler import reasons
from lattice_scheduler.filters import (
    FLAG_PREFER_LOCAL_MEMORY,
    FLAG_PREFER_SAME_NUMA,
    FLAG_REQUIRE_CONFORMANCE,
    constraint_flags,
    filter_kwargs,
    signature_matches,
)
from lattice_scheduler.topology import (
    UNUSABLE_STATES,
    TopologyModel,
    fewest_groups,
    min_groups,
)

INF = math.inf

REASON_QUOTA = reasons.QUOTA
REASON_NO_MATCH = reasons.NO_MATCH
REASON_OCCUPIED = reasons.OCCUPIED
REASON_CONFORMANCE = reasons.CONFORMANCE
REASON_POWER = reasons.POWER

Conf = str | None  # conformance fingerprint; None = unknown (a group of one per node)
Plan = dict[int, dict[Conf, int]]  # group -> conformance -> node count
Mode = Literal["pack", "tight", "any"]


class Proposal(msgspec.Struct, frozen=True):
    allocation_id: str
    node_ids: tuple[str, ...]
    groups_spanned: int = 1
    conformance_fitness: float = 1.0  # f9: largest conformance group among nodes / nodes
    backfilled: bool = False  # started while a higher-scored allocation was blocked
    memory_locality: float = 1.0  # share of nodes with one memory domain
    score: float = 0.0


class Reservation(msgspec.Struct, frozen=True):
    allocation_id: str
    start_time: float
    node_ids: tuple[str, ...]
    end_time: float = INF  # start + walltime; inf for allocations without walltime


class Pending(msgspec.Struct, frozen=True):
    """Why an allocation was not placed this cycle: ``reason`` is the kind (the
    troubleshooting table's words, which the scheduler's logic compares), ``detail`` the
    numbers behind it; users read :attr:`text` (lattice_scheduler.reasons)."""

    allocation_id: str
    reason: str
    detail: str = ""

    @property
    def text(self) -> str:
        return reasons.text(self.reason, self.detail)


class SolveResult(msgspec.Struct):
    proposals: list[Proposal]
    reservations: list[Reservation]
    pending: list[Pending]
    scores: dict[str, float] = msgspec.field(default_factory=dict)
    #: the ids in the order the queue was considered (step 1)
    order: list[str] = msgspec.field(default_factory=list)

    @property
    def reasons(self) -> dict[str, str]:
        return {p.allocation_id: p.reason for p in self.pending}


# --- selection over counts ------------------------------------------------------------


def _conf_key(c: Conf) -> tuple[bool, str]:
    return (c is None, c or "")


def _fill(order: Iterable[tuple[int, Conf, int]], k: int) -> Plan:
    plan: Plan = {}
    need = k
    for g, c, n in order:
        if need <= 0:
            break
        take = n if n < need else need
        if take > 0:
            plan.setdefault(g, {})[c] = plan.get(g, {}).get(c, 0) + take
            need -= take
    return plan


def choose(
    by_group: Mapping[int, Mapping[Conf, int]],
    totals: Mapping[int, int],
    total: int,
    k: int,
    *,
    mode: Mode = "pack",
    require_conformance: bool = False,
    max_span: int | None = None,
) -> Plan | None:
    """How many nodes to take from each (group, conformance group) cell, given the
    candidate counts per cell; None when rule (c) of the module docstring cannot be met.
    ``max_span`` bounds the groups used ("tight")."""
    if total < k or k <= 0:
        return None
    if k == 1:
        # Conformance and span are trivial: the tightest group, and in it the smallest
        # conformance group (fragments first, keeping large homogeneous sets whole).
        g = min((t, g) for g, t in totals.items() if t > 0)[1]
        per = by_group[g]
        c = min((c for c, n in per.items() if n > 0), key=lambda c: (per[c], *_conf_key(c)))
        return {g: {c: 1}}
    if require_conformance:
        return _choose_conformant(by_group, k, mode, max_span)
    if mode == "any":
        return _choose_any(by_group, k)
    fitting = [g for g, t in totals.items() if t >= k]
    if fitting:

        def single_key(g: int) -> tuple[int, int, int]:
            best = 0
            for c, n in by_group[g].items():
                size = n if c is not None else 1
                if size > best:
                    best = size
            return (-min(best, k), totals[g], g)

        g = min(fitting, key=single_key)
        per = by_group[g]
        confs = sorted(per, key=lambda c: (-(per[c] if c is not None else 1), *_conf_key(c)))
        return _fill(((g, c, per[c]) for c in confs), k)
    groups = fewest_groups(totals, k, max_span=max_span)
    if groups is None:
        return None
    within: dict[Conf, int] = {}
    for g in groups:
        for c, n in by_group[g].items():
            within[c] = within.get(c, 0) + n
    confs = sorted(within, key=lambda c: (c is None, -within[c], c or ""))
    return _fill(((g, c, by_group[g].get(c, 0)) for c in confs for g in groups), k)


def _conf_totals(by_group: Mapping[int, Mapping[Conf, int]]) -> dict[str, int]:
    ct: dict[str, int] = {}
    for per in by_group.values():
        for c, n in per.items():
            if c is not None:
                ct[c] = ct.get(c, 0) + n
    return ct


def _choose_conformant(
    by_group: Mapping[int, Mapping[Conf, int]], k: int, mode: Mode, max_span: int | None
) -> Plan | None:
    ct = _conf_totals(by_group)
    best: tuple[tuple[object, ...], str, dict[int, int], list[int]] | None = None
    for c in sorted(x for x, n in ct.items() if n >= k):
        cg = {g: per[c] for g, per in by_group.items() if per.get(c)}
        if mode == "any":
            groups = sorted(cg, key=lambda g: (-cg[g], g))
            key: tuple[object, ...] = (-ct[c], c)
        else:
            found = fewest_groups(cg, k, max_span=max_span)
            if found is None:
                continue
            groups = found
            key = (len(groups), -ct[c], c)
        if best is None or key < best[0]:
            best = (key, c, cg, groups)
    if best is None:
        return None
    _, c, cg, groups = best
    return _fill(((g, c, cg[g]) for g in groups), k)


def _choose_any(by_group: Mapping[int, Mapping[Conf, int]], k: int) -> Plan | None:
    ct = _conf_totals(by_group)
    fits = [c for c, n in ct.items() if n >= k]
    if fits:
        c = min(fits, key=lambda c: (-ct[c], c))
        cg = {g: per[c] for g, per in by_group.items() if per.get(c)}
        groups = fewest_groups(cg, k) or []
        return _fill(((g, c, cg[g]) for g in groups), k)
    order: list[tuple[int, Conf, int]] = []
    for c in sorted(ct, key=lambda c: (-ct[c], c)):
        cells = [(g, per[c]) for g, per in by_group.items() if per.get(c)]
        order.extend((g, c, n) for g, n in sorted(cells, key=lambda x: (-x[1], x[0])))
    unknown = [(g, per[None]) for g, per in by_group.items() if per.get(None)]
    order.extend((g, None, n) for g, n in sorted(unknown, key=lambda x: (-x[1], x[0])))
    plan = _fill(order, k)
    return plan if sum(sum(p.values()) for p in plan.values()) == k else None


def plan_fitness(plan: Plan, k: int) -> tuple[int, float]:
    """(groups spanned, f9 conformance fitness) of a plan for ``k`` nodes."""
    per_conf: dict[str, int] = {}
    unknown = 0
    for per in plan.values():
        for c, n in per.items():
            if c is None:
                unknown += n
            else:
                per_conf[c] = per_conf.get(c, 0) + n
    largest = max(per_conf.values(), default=0)
    if largest == 0 and unknown:
        largest = 1
    return sum(1 for per in plan.values() if any(per.values())), (
        min(1.0, largest / k) if k else 1.0
    )


# --- the per-cycle index --------------------------------------------------------------


class _Avail:
    """When the usable nodes of some signatures become available, for reservations:
    per (group, conf) cell, the nodes that will be (avail != INF) sorted by (time, id),
    as parallel lists of times and ids. Built at a cycle's first reservation;
    ``occupy`` marks the cells it changes and :meth:`refresh` re-sorts only those
    before the next reservation (cheaper than keeping every cell sorted node by node,
    and free after the cycle's last reservation)."""

    __slots__ = ("cells", "dirty", "members")

    def __init__(self, members: dict[tuple[int, Conf], list[str]]) -> None:
        self.members = members  # cell -> its usable nodes, in id order
        self.cells: dict[tuple[int, Conf], tuple[list[float], list[str]]] = {}
        self.dirty: set[tuple[int, Conf]] = set(members)

    def refresh(self, avail: Mapping[str, float]) -> None:
        by_time = avail.__getitem__
        for cell in self.dirty:
            ids = sorted(self.members[cell], key=by_time)  # stable: (time, id) order
            ts = list(map(by_time, ids))
            never = bisect_left(ts, INF)  # nodes never available sort last: drop them
            del ts[never:], ids[never:]
            self.cells[cell] = (ts, ids)
        self.dirty.clear()


def _shift(cell: tuple[list[float], list[str]], lo: int, hi: int, end: float) -> None:
    """Move the nodes at ``lo:hi`` of an availability cell (all available by some time
    before ``end``) to ``end``, keeping the cell in (time, id) order; nodes that will
    never be available (``end`` INF) leave it."""
    ts, ids = cell
    block = ids[lo:hi]
    del ts[lo:hi], ids[lo:hi]
    if end == INF:
        return
    block.sort()
    at = bisect_left(ts, end)
    past = bisect_right(ts, end, at)
    if at != past:  # nodes already available at ``end``: merge by id
        block = sorted(ids[at:past] + block)
    ts[at:past] = [end] * len(block)
    ids[at:past] = block


class _Usable(NamedTuple):
    """The nodes a vCluster's cycle may use (home "" or the vCluster, enabled, not
    claimed, not Down/Failed), by what does not change while a topology model lives."""

    ready: list[tuple[str, Node, int, tuple[int, Conf], tuple[float, int, Conf, int]]]
    not_ready: list[str]  # usable but not Ready (e.g. Draining): never available
    sig_nodes: dict[int, list[tuple[str, int, Conf]]]  # signature -> (id, group, conf)
    usable_cells: dict[int, dict[tuple[int, Conf], int]]  # signature -> cell -> nodes
    where: dict[str, tuple[int, tuple[int, Conf]]]  # id -> (signature, cell)
    # signatures -> cell -> the cell's nodes of those signatures in id order (_Avail)
    cell_members: dict[frozenset[int], dict[tuple[int, Conf], list[str]]]


def _usable(topo: TopologyModel, vcluster: str) -> _Usable:
    """The usable nodes, worked out once per model and vCluster (``topo.derived``):
    RM-Replay keeps one model for a whole replay, and this scan of every node was the
    largest part of setting up each cycle. Owners are read live by the caller."""
    key = ("solver.usable", vcluster)
    got = topo.derived.get(key)
    if isinstance(got, _Usable):
        return got
    node_sig = topo.node_signature
    out = _Usable([], [], {}, {}, {}, {})
    ready = NodeState.READY
    for nid, n in topo.nodes.items():  # sorted by id
        home = n.home_vcluster
        if (
            (home and home != vcluster)
            or n.disabled
            or n.claimed_by  # serves only its user's sensitive work
            or n.state in UNUSABLE_STATES
        ):
            continue
        g = n.group
        c: Conf = n.conformance_group or None
        s = node_sig[nid]
        cell = (g, c)
        nodes_of_sig = out.sig_nodes.get(s)
        if nodes_of_sig is None:
            nodes_of_sig = out.sig_nodes[s] = []
            out.usable_cells[s] = {}
        nodes_of_sig.append((nid, g, c))
        uc = out.usable_cells[s]
        uc[cell] = uc.get(cell, 0) + 1
        out.where[nid] = (s, cell)
        if n.state != ready:
            out.not_ready.append(nid)
        else:
            out.ready.append((nid, n, s, cell, (INF, g, c, s)))
    topo.derived[key] = out
    return out


class _View:
    """Free candidate counts for one constraint key, kept current as nodes are taken."""

    __slots__ = (
        "agg",
        "free_any",
        "free_total",
        "ideal",
        "max_conf",
        "nodes",
        "sig_order",
        "sigs",
        "tot",
        "usable_by_conf",
        "usable_by_group",
        "usable_total",
        "when",
    )

    def __init__(self, sigs: list[int], sig_order: list[int]) -> None:
        self.sigs = frozenset(sigs)
        self.sig_order = sig_order
        self.agg: dict[float, dict[int, dict[Conf, int]]] = {}
        self.tot: dict[float, dict[int, int]] = {}
        self.free_total: dict[float, int] = {}
        self.free_any = 0  # free candidates in every tier (a full cluster: often 0)
        self.usable_by_group: dict[int, int] = {}
        self.usable_by_conf: dict[str, dict[int, int]] = {}
        self.usable_total = 0
        self.ideal: dict[tuple[bool, int], int | None] = {}  # (conformance, k) -> span
        self.max_conf = -1
        self.nodes: list[tuple[str, int, Conf]] = []
        # the availability index of the view's nodes (see _Cycle._avail); None until
        # the view's first reservation of the cycle
        self.when: _Avail | None = None

    def add(self, tier: float, g: int, c: Conf, n: int) -> None:
        by_group = self.agg.get(tier)
        if by_group is None:
            by_group = self.agg[tier] = {}
            self.tot[tier] = {}
            self.free_total[tier] = 0
        per = by_group.get(g)
        if per is None:
            per = by_group[g] = {}
        left = per.get(c, 0) + n
        if left:
            per[c] = left
        else:
            del per[c]
            if not per:
                del by_group[g]
        tot = self.tot[tier]
        left = tot.get(g, 0) + n
        if left:
            tot[g] = left
        else:
            del tot[g]
        self.free_total[tier] += n
        self.free_any += n

    def largest_usable_conf(self) -> int:
        if self.max_conf < 0:
            self.max_conf = max((sum(p.values()) for p in self.usable_by_conf.values()), default=0)
        return self.max_conf

    def ideal_span(self, require_conformance: bool, k: int) -> int | None:
        """Fewest groups the job could use if every usable matching node were free."""
        if require_conformance and k > 1:
            spans = [
                m for per in self.usable_by_conf.values() if (m := min_groups(per, k)) is not None
            ]
            return min(spans, default=None)
        return min_groups(self.usable_by_group, k)


class _Cycle:
    def __init__(
        self,
        topo: TopologyModel,
        running: Iterable[Allocation],
        *,
        now: float,
        vcluster: str,
        count_usage: bool = True,
    ) -> None:
        self.topo = topo
        self.now = now
        self.sigs = topo.signatures
        # free[tier][(group, conf)][sig] -> sorted free node ids; tier = the earliest start
        # of a reservation holding the node, INF when none holds it
        self.free: dict[float, dict[tuple[int, Conf], dict[int, list[str]]]] = {INF: {}}
        self.loc: dict[str, tuple[float, int, Conf, int]] = {}  # free node -> its cell
        self.avail: dict[str, float] = {}  # usable node -> when it can be used
        self.views: dict[tuple[object, ...], _View] = {}
        # constraints as written -> (view, require_conformance flag)
        self.raw_views: dict[tuple[object, ...], tuple[_View, bool]] = {}
        self.sig_views: dict[int, list[_View]] = {}
        # availability indexes by the signatures they cover (views with the same
        # signatures share one), and by signature for occupy
        self.when_of: dict[frozenset[int], _Avail] = {}
        self.when_by_sig: dict[int, list[_Avail]] = {}
        # the last reservation's nodes: (index searched, [(cell, start, stop)] of them)
        self.reserved: tuple[_Avail, list[tuple[tuple[int, Conf], int, int]]] | None = None
        self.used_nodes: dict[str, int] = {}
        self.used_allocs: dict[str, int] = {}

        ends: dict[str, float] = {}
        used_nodes = self.used_nodes
        used_allocs = self.used_allocs
        holding = HOLDING_STATES
        for a in running:
            if a.state not in holding:
                continue
            spec = a.spec
            if count_usage:  # only quotas read it
                t = spec.tenant
                used_nodes[t] = used_nodes.get(t, 0) + len(a.assigned_nodes)
                used_allocs[t] = used_allocs.get(t, 0) + 1
            w = spec.walltime_seconds
            if w > 0:
                start = a.started_at if a.started_at is not None else now
                end = start + w
                ends[a.id] = end if end > now else now  # max(now, end)

        usable = _usable(topo, vcluster)
        # shared with the model's later cycles: read only
        self.sig_nodes: dict[int, list[tuple[str, int, Conf]]] = usable.sig_nodes
        self.usable_cells: dict[int, dict[tuple[int, Conf], int]] = usable.usable_cells
        self.where = usable.where
        self.cell_members = usable.cell_members
        avail = self.avail
        for nid in usable.not_ready:
            avail[nid] = INF
        main = self.free[INF]
        loc = self.loc
        for nid, n, s, cell, free_loc in usable.ready:  # sorted by id
            owner = n.owner
            if owner:
                avail[nid] = ends.get(owner, INF)
            else:
                avail[nid] = now
                per_sig = main.get(cell)
                if per_sig is None:
                    per_sig = main[cell] = {}
                lst = per_sig.get(s)
                if lst is None:
                    lst = per_sig[s] = []
                lst.append(nid)
                loc[nid] = free_loc

    # views ------------------------------------------------------------------------------

    def view(self, spec: AllocationSpec) -> tuple[_View, bool]:
        """The view of the allocation's constraints, and whether it asks for
        ``require_conformance``; worked out once per distinct constraints a cycle."""
        c = spec.constraints
        raw = (c.gpu_type, c.gpu_count, c.memory_gb, *c.features)
        got = self.raw_views.get(raw)
        if got is None:
            flags = constraint_flags(spec)
            got = self.raw_views[raw] = (
                self._view(spec, flags),
                FLAG_REQUIRE_CONFORMANCE in flags,
            )
        return got

    def _view(self, spec: AllocationSpec, flags: frozenset[str]) -> _View:
        kw = filter_kwargs(spec)
        numa = FLAG_PREFER_SAME_NUMA in flags or FLAG_PREFER_LOCAL_MEMORY in flags
        key = (*kw.values(), numa)
        v = self.views.get(key)
        if v is not None:
            return v
        sigs = [
            s
            for s, sig in enumerate(self.sigs)
            if s in self.sig_nodes and signature_matches(sig, **kw)  # type: ignore[arg-type]
        ]

        def order(s: int) -> tuple[object, ...]:
            sig = self.sigs[s]
            return (not sig.numa_local if numa else False, *sig.sort_key(), s)

        v = _View(sigs, sorted(sigs, key=order))
        for tier, cells in self.free.items():
            for (g, c), per_sig in cells.items():
                n = 0
                for s, lst in per_sig.items():
                    if s in v.sigs:
                        n += len(lst)
                if n:
                    v.add(tier, g, c, n)
        for s in sigs:
            for (g, c), n in self.usable_cells[s].items():
                v.usable_by_group[g] = v.usable_by_group.get(g, 0) + n
                v.usable_total += n
                if c is not None:
                    per = v.usable_by_conf.setdefault(c, {})
                    per[g] = per.get(g, 0) + n
            self.sig_views.setdefault(s, []).append(v)
            v.nodes.extend(self.sig_nodes[s])
        self.views[key] = v
        return v

    def candidates(
        self, v: _View, end: float, k: int
    ) -> tuple[Mapping[int, Mapping[Conf, int]], Mapping[int, int], int, list[float]] | None:
        """Free candidate counts usable by a job ending at ``end``: unreserved nodes and
        nodes whose reservations all start at or after ``end``; None when fewer than
        ``k`` (most of the queue, on a full cluster: counted before merging tiers)."""
        if v.free_any < k:
            return None
        tiers: list[float] = []
        total = 0
        for t, n in v.free_total.items():
            if n > 0 and t >= end:
                tiers.append(t)
                total += n
        if total < k:
            return None
        tiers.sort(reverse=True)  # unreserved first, then the latest reservations
        if len(tiers) == 1:
            t = tiers[0]
            return v.agg[t], v.tot[t], v.free_total[t], tiers
        by_group: dict[int, dict[Conf, int]] = {}
        totals: dict[int, int] = {}
        for t in tiers:
            for g, per in v.agg[t].items():
                dst = by_group.setdefault(g, {})
                for c, n in per.items():
                    dst[c] = dst.get(c, 0) + n
            for g, n in v.tot[t].items():
                totals[g] = totals.get(g, 0) + n
        return by_group, totals, total, tiers

    # taking and reserving -----------------------------------------------------------------

    def take(
        self, v: _View, plan: Plan, tiers: list[float]
    ) -> list[tuple[str, tuple[float, int, Conf, int]]]:
        """Remove the planned nodes from the free index: (node id, where it was)."""
        out: list[tuple[str, tuple[float, int, Conf, int]]] = []
        for g, per in plan.items():
            for c, want in per.items():
                need = want
                for tier in tiers:
                    per_sig = self.free[tier].get((g, c))
                    if not per_sig:
                        continue
                    for s in v.sig_order:
                        lst = per_sig.get(s)
                        if not lst:
                            continue
                        n = need if need < len(lst) else len(lst)
                        got = lst[:n]
                        del lst[:n]
                        loc = self.loc
                        for nid in got:
                            out.append((nid, loc.pop(nid)))
                        for w in self.sig_views.get(s, ()):
                            w.add(tier, g, c, -n)
                        need -= n
                        if not need:
                            break
                    if not need:
                        break
                if need:  # pragma: no cover - counts and lists disagree
                    raise AssertionError(f"free index out of sync at group {g}, {c!r}")
        return out

    def withdraw(self, node_ids: Iterable[str]) -> list[tuple[str, tuple[float, int, Conf, int]]]:
        """Take these nodes out of the free index for one allocation (those its prologue
        failed on); ``put_back`` returns them."""
        out: list[tuple[str, tuple[float, int, Conf, int]]] = []
        for nid in node_ids:
            loc = self.loc.pop(nid, None)
            if loc is None:
                continue
            tier, g, c, s = loc
            self.free[tier][(g, c)][s].remove(nid)
            for w in self.sig_views.get(s, ()):
                w.add(tier, g, c, -1)
            out.append((nid, loc))
        return out

    def put_back(self, nodes: Iterable[tuple[str, tuple[float, int, Conf, int]]]) -> None:
        for nid, loc in nodes:
            self._insert(nid, loc)

    def _insert(self, nid: str, loc: tuple[float, int, Conf, int]) -> None:
        tier, g, c, s = loc
        cells = self.free.setdefault(tier, {})
        insort(cells.setdefault((g, c), {}).setdefault(s, []), nid)
        self.loc[nid] = loc
        for w in self.sig_views.get(s, ()):
            w.add(tier, g, c, 1)

    def occupy(self, nodes: Iterable[str], until: float) -> None:
        avail = self.avail
        by_sig = self.when_by_sig
        for nid in nodes:
            if avail[nid] < until:
                avail[nid] = until
                if by_sig:
                    s, cell = self.where[nid]
                    for when in by_sig.get(s, ()):
                        when.dirty.add(cell)

    def no_more_reservations(self) -> None:
        """The cycle will not call ``reserve`` again: stop keeping availability indexes
        (``occupy`` is cheaper without them; a later ``reserve`` would rebuild them)."""
        self.when_of.clear()
        self.when_by_sig.clear()
        self.reserved = None
        for v in self.views.values():
            v.when = None

    def reserve(
        self, v: _View, k: int, *, mode: Mode, require_conformance: bool, max_span: int | None
    ) -> tuple[float, list[str]] | None:
        """Earliest start and node set for a blocked job, or None if never (by the
        expected ends known now)."""
        times_of = self._avail(v)
        if sum(len(ts) for ts, _ in times_of.values()) < k:
            return None  # fewer than k nodes ever available (choose's first test)

        def plan_at(t: float) -> Plan | None:
            by_group: dict[int, dict[Conf, int]] = {}
            totals: dict[int, int] = {}
            total = 0
            for (g, c), (ts, _) in times_of.items():
                n = bisect_right(ts, t)
                if n:
                    by_group.setdefault(g, {})[c] = n
                    totals[g] = totals.get(g, 0) + n
                    total += n
            return choose(
                by_group,
                totals,
                total,
                k,
                mode=mode,
                require_conformance=require_conformance,
                max_span=max_span,
            )

        # The earliest time with a plan. More nodes never make a plan impossible (rule
        # (c) only asks for enough nodes in few enough groups or one conformance group),
        # so a plan exists from some time on: search the availability times for it.
        # Before the k-th earliest one (found among the k earliest of each cell) there
        # are fewer than k nodes; from it on, a plain "pack" job always fits, so the
        # first probe is usually the last.
        start = sorted(chain.from_iterable(ts[:k] for ts, _ in times_of.values()))[k - 1]
        plan = plan_at(start)
        if plan is None:
            times = sorted(chain.from_iterable(ts for ts, _ in times_of.values()))
            last = plan_at(times[-1])
            if last is None:
                return None
            lo, hi = bisect_right(times, start), len(times) - 1
            plan, start = last, times[-1]
            while lo < hi:  # times[hi] has a plan; no time before times[lo] has one
                t = times[(lo + hi) // 2]
                found = plan_at(t)
                if found is not None:
                    plan, start = found, t
                    hi = bisect_left(times, t)
                else:
                    lo = bisect_right(times, t)
        # In each cell, the nodes that come free last (by the start): nodes free now stay
        # available to backfill wherever the reservation can do without them.
        chosen: list[str] = []
        runs: list[tuple[tuple[int, Conf], int, int]] = []
        for g, per in plan.items():
            for c, n in per.items():
                ts, ids = times_of[(g, c)]
                ready = bisect_right(ts, start)
                chosen.extend(ids[ready - n : ready])
                runs.append(((g, c), ready - n, ready))
        assert v.when is not None
        self.reserved = (v.when, runs)  # for hold_for, called next with these nodes
        return start, sorted(chosen)

    def _avail(self, v: _View) -> dict[tuple[int, Conf], tuple[list[float], list[str]]]:
        """The view's availability index (:class:`_Avail`), current: a cycle reserves up
        to ``backfill_depth`` times, mostly for the same few views, and rescanning and
        sorting every node for each reservation dominated the cycle on large clusters."""
        when = v.when
        if when is None:
            when = self.when_of.get(v.sigs)
            if when is None:
                members = self.cell_members.get(v.sigs)
                if members is None:  # static while the model lives: kept with it
                    members = self.cell_members[v.sigs] = {}
                    for nid, g, c in v.nodes:
                        ids = members.get((g, c))
                        if ids is None:
                            ids = members[(g, c)] = []
                        ids.append(nid)
                    if len(v.sigs) > 1:  # one signature's nodes are listed in id order
                        for ids in members.values():
                            ids.sort()
                when = self.when_of[v.sigs] = _Avail(members)
                for s in v.sigs:
                    self.when_by_sig.setdefault(s, []).append(when)
            v.when = when
        if when.dirty:
            when.refresh(self.avail)
        return when.cells

    def hold_for(self, nodes: list[str], start: float, end: float) -> None:
        """Record a reservation: its nodes are busy until ``end`` for later reservations,
        and free ones move to the tier of the earliest reservation holding them."""
        found = self.reserved
        self.reserved = None
        if found is None:
            self.occupy(nodes, end)
        else:
            # the nodes ``reserve`` just returned: in the index it searched they are one
            # run per cell, moved as a block (re-sorting those cells was most of the
            # cost of a reservation); other indexes only learn which cells changed
            when, runs = found
            for cell, lo, hi in runs:
                _shift(when.cells[cell], lo, hi, end)
            # all were available by ``start``, before ``end``: all move (as occupy)
            self.avail.update(dict.fromkeys(nodes, end))
            if len(self.when_of) > 1:
                by_sig = self.when_by_sig
                for nid in nodes:
                    s, cell = self.where[nid]
                    for other in by_sig.get(s, ()):
                        if other is not when:
                            other.dirty.add(cell)
        # free nodes held by a later tier move to this one, a cell at a time (one count
        # update per view and cell, not per node)
        loc_of = self.loc
        moving: dict[tuple[float, int, Conf, int], list[str]] = {}
        for nid in nodes:
            loc = loc_of.get(nid)
            if loc is not None and loc[0] > start:
                moving.setdefault(loc, []).append(nid)
        for (tier, g, c, s), nids in moving.items():
            src = self.free[tier][(g, c)][s]
            dst = self.free.setdefault(start, {}).setdefault((g, c), {}).setdefault(s, [])
            new = (start, g, c, s)
            for nid in nids:
                src.remove(nid)
                insort(dst, nid)
                loc_of[nid] = new
            for w in self.sig_views.get(s, ()):
                w.add(tier, g, c, -len(nids))
                w.add(start, g, c, len(nids))


# --- the solver -----------------------------------------------------------------------


def queue_key(a: Allocation, score: float) -> tuple[float, int, float, str]:
    """Step 1's order of the queue: score descending, then preemption class descending,
    original submit time, id (unique: it breaks every tie)."""
    return (-score, -a.spec.preemption_class, a.submitted_at, a.id)


def solve(
    pending: Iterable[Allocation],
    nodes: Mapping[str, Node] | Iterable[Node],
    running: Iterable[Allocation] = (),
    *,
    score: Callable[[Allocation], float],
    now: float,
    backfill_depth: int = 10,
    vcluster: str = "",
    tenants: Mapping[str, Tenant] | None = None,
    exclude: Iterable[str] = (),
    topology: TopologyModel | None = None,
    power_headroom_kw: float | None = None,
    node_power_kw: Mapping[str, float] | None = None,
) -> SolveResult:
    """One scheduling decision for one vCluster (see the module docstring).

    ``pending``: allocations to consider (those not Pending, in ``exclude``, or of another
    vCluster when ``vcluster`` is set are skipped). ``nodes``: every node (the mirror's
    dict). ``running``: the allocations holding nodes (any vCluster): quota usage and
    expected node release times. ``score``: the cost function, called once per
    allocation. ``topology``: a model built this cycle (built here when omitted).
    """
    skip = set(exclude)
    queue = [
        a
        for a in pending
        if a.state == AllocationState.PENDING
        and a.id not in skip
        and (not vcluster or a.spec.vcluster == vcluster)
    ]
    scores = {a.id: float(score(a)) for a in queue}
    queue.sort(key=lambda a: queue_key(a, scores[a.id]))
    result = SolveResult(
        proposals=[], reservations=[], pending=[], scores=scores, order=[a.id for a in queue]
    )
    if not queue:
        return result
    topo = topology if topology is not None else TopologyModel.from_nodes(nodes)
    tenants = tenants or {}
    quotas = any(
        t.max_nodes is not None or t.max_concurrent_allocations is not None
        for t in tenants.values()
    )
    cyc = _Cycle(topo, running, now=now, vcluster=vcluster, count_usage=quotas)
    raw_views = cyc.raw_views
    headroom = power_headroom_kw
    power = node_power_kw or {}
    depth_left = max(0, backfill_depth)
    blocked_above = False
    now_ = now
    unusable_cache: dict[tuple[object, ...], int] = {}
    withheld: list[tuple[str, tuple[float, int, Conf, int]]] = []

    for a in queue:
        if withheld:
            cyc.put_back(withheld)
            withheld = []
        spec = a.spec
        k = max(1, spec.nodes)
        tname = spec.tenant
        t = tenants.get(tname)
        if t is not None:
            quota = reasons.quota(t, cyc.used_nodes.get(tname, 0), cyc.used_allocs.get(tname, 0), k)
            if quota:
                result.pending.append(Pending(a.id, REASON_QUOTA, quota))
                continue
        c = spec.constraints  # (cyc.view, without the call for a known key)
        got = raw_views.get((c.gpu_type, c.gpu_count, c.memory_gb, *c.features))
        v, conformance = got if got is not None else cyc.view(spec)
        if a.excluded_nodes:  # its prologue failed there: never again for it
            withheld = cyc.withdraw(a.excluded_nodes)
        if v.usable_total < k:
            unusable = _unusable_matching(topo, spec, vcluster, unusable_cache)
            detail = reasons.too_few_nodes(k, vcluster, v.usable_total, unusable)
            kind = reasons.WAITING_FOR_CAPACITY if spec.wait_for_capacity else REASON_NO_MATCH
            result.pending.append(Pending(a.id, kind, detail))
            continue
        need_conf = conformance and k > 1
        if need_conf and (largest := v.largest_usable_conf()) < k:
            detail = reasons.conformance(k, max(largest, 0))
            result.pending.append(Pending(a.id, REASON_CONFORMANCE, detail))
            continue
        if not depth_left and v.free_any < k:
            # nothing free to start on and no reservation left to make: on a full
            # cluster, most of the queue (the same outcome as the steps below)
            result.pending.append(Pending(a.id, REASON_OCCUPIED))
            blocked_above = True
            continue
        topo_hint = spec.constraints.topology
        mode: Mode = "any" if topo_hint == "any" else "tight" if topo_hint == "tight" else "pack"
        max_span = None
        if mode == "tight":
            ikey = (need_conf, k)
            if ikey in v.ideal:
                max_span = v.ideal[ikey]
            else:
                max_span = v.ideal[ikey] = v.ideal_span(need_conf, k)
        w = spec.walltime_seconds
        end = now_ + w if w > 0 else INF
        found_free = None
        if v.free_any >= k:  # (most of the queue, on a full cluster: not even that)
            found_free = cyc.candidates(v, end, k)
        if found_free is None:  # fewer than k candidates: choose would say None
            plan, tiers = None, []
        else:
            by_group, totals, total, tiers = found_free
            plan = choose(
                by_group,
                totals,
                total,
                k,
                mode=mode,
                require_conformance=need_conf,
                max_span=max_span,
            )
        if plan is not None:
            taken = cyc.take(v, plan, tiers)
            chosen = [nid for nid, _ in taken]
            if headroom is not None:
                draw = sum(power.get(n, 0.0) for n in chosen)
                if draw > headroom:
                    cyc.put_back(taken)
                    result.pending.append(Pending(a.id, REASON_POWER))
                    continue
                headroom -= draw
            cyc.occupy(chosen, end)
            cyc.used_nodes[tname] = cyc.used_nodes.get(tname, 0) + k
            cyc.used_allocs[tname] = cyc.used_allocs.get(tname, 0) + 1
            spanned, fitness = plan_fitness(plan, k)
            local = sum(1 for n in chosen if topo.signature(n).numa_local)
            result.proposals.append(
                Proposal(
                    allocation_id=a.id,
                    node_ids=tuple(sorted(chosen)),
                    groups_spanned=spanned,
                    conformance_fitness=fitness,
                    backfilled=blocked_above,
                    memory_locality=local / k,
                    score=scores[a.id],
                )
            )
            continue
        blocked_above = True
        result.pending.append(Pending(a.id, REASON_OCCUPIED))
        if depth_left > 0:
            found = cyc.reserve(v, k, mode=mode, require_conformance=need_conf, max_span=max_span)
            if found is not None:
                depth_left -= 1
                if not depth_left:
                    cyc.no_more_reservations()
                start, reserved = found
                r_end = start + w if w > 0 else INF
                cyc.hold_for(reserved, start, r_end)
                result.reservations.append(Reservation(a.id, start, tuple(reserved), r_end))

    return result


def _unusable_matching(
    topo: TopologyModel, spec: AllocationSpec, vcluster: str, cache: dict[tuple[object, ...], int]
) -> int:
    """Nodes of ``vcluster``'s pool (or the shared one) that meet ``spec``'s hard
    constraints but are down, failed or disabled: capacity that may come back."""
    c = spec.constraints
    key = (c.gpu_type, c.gpu_count, c.memory_gb, *c.features)
    got = cache.get(key)
    if got is None:
        kw = filter_kwargs(spec)
        got = cache[key] = sum(
            1
            for nid, n in topo.nodes.items()
            if n.home_vcluster in ("", vcluster)
            and (n.disabled or n.state in UNUSABLE_STATES)
            and signature_matches(topo.signature(nid), **kw)  # type: ignore[arg-type]
        )
    return got
