"""The discrete-event replay: arrivals, scheduling cycles, completions, preemptions,
all in simulated time.

State is a ``lattice_common.watch.StateMirror`` (allocations, nodes, tenants,
vClusters and the pending/holding indexes), kept exactly as the quorum would keep it
after each command: a policy (:mod:`rm_replay.policies`; ``lattice`` is the real
scheduler) decides on it, and the engine applies the decision the way the quorum's
``AssignNodes`` and ``PreemptAllocation`` do, with the quorum's own checks
(``lattice_common.assignment``: Pending, node range, takeable nodes, sensitive claims,
hard tenant quotas; preemption only downwards or to reclaim), then plays the
consequences forward. Not replayed: sensitive node claims (a replayed sensitive
allocation does not claim its nodes) and with them ``sensitive_pool_size``.

* **arrival** at the submit time: the allocation becomes Pending (and, with
  ``schedule_on_arrival``, pokes the scheduler when some node is free, as the live
  loop does; on a full cluster it waits for freed capacity or the interval);
* **cycles**: at once after an arrival (if configured), after nodes are freed or work
  is requeued (the live loop's pokes), and every ``cycle_interval`` after the last
  cycle while work is pending. A cycle runs the policy only when it could change
  something: some pending allocation of the vCluster has at least as many free
  matching nodes as it asks for (otherwise no placement is possible, whatever the
  order), or, for ``lattice``, a preemption is possible (a pending class above a
  running one, or a borrower on the vCluster's home pool). Skipping the others
  leaves the outcome unchanged and keeps a replay fast;
* **end** at start + actual runtime (exit 0: ``completed``, else ``failed``), or at
  start + walltime with ``walltime_exceeded`` when the runtime exceeds the request;
* **preemption**: the victim goes Checkpointing (keeps its nodes) for
  ``checkpoint_seconds``, then releases them and is requeued Pending with its
  original submit time, ``preempted_count + 1`` and ``preempted_by`` set (the
  scheduler holds it back until its preemptor has started). The checkpoint succeeds
  with probability ``checkpoint_success_rate``, drawn from
  ``random.Random(f"{seed}:{allocation}:{attempt}")`` (independent of event order):
  on success the work done before the preemption is kept, otherwise it is lost. A
  victim whose run ends during its checkpoint simply ends;
* **without a checkpoint** (the submission says ``checkpoint: none``, or the replay
  runs with ``checkpoint_broker=False``, the counterfactual of Lattice without its
  checkpoint broker: preemption is SIGTERM), a victim releases its nodes at once and
  its work since its last start is lost; that work, and that of failed checkpoints,
  is counted in ``JobRecord.lost_node_seconds`` (node-seconds to compute again);
* **reactive allocations** (``lifecycle: reactive``, a node range and a ``load``
  profile): started at ``min_nodes``, then every ``evaluation_interval`` of their run
  the real ``lattice_scheduler.autoscale.decide`` reads the samples of their load
  profile and they take one free node of their pool (the first by id that meets their
  constraints, within the tenant's ``max_nodes``) or release their newest one, as the
  live autoscaler's ``ScaleAllocation`` does. A preempted one restarts at
  ``min_nodes``. A borrowed node (placed by the scheduler's elastic borrowing) whose
  home vCluster has work waiting is given back at the next evaluation, as the live
  autoscaler gives it back within the borrowed-node grace (and the scheduler does not
  preempt the allocation for it). Not modelled: the checkpoint before a scale-down (the
  application's state is not simulated; the node goes at the decision);
* **cancel** at the trace's cancel time (the user withdrew an allocation that never
  started in the captured system): still Pending (also after a preemption and
  requeue), it leaves the queue without running; running or checkpointing in the
  replay (whose schedule differs from the live one), it ends then like a user's
  cancel of a running job, its nodes freed and its node time counted up to the
  cancel; both end in state ``cancelled``. One that already ended is left alone
  (the cancel is dropped without advancing the clock). A cancel that frees nodes
  pokes the scheduler, as a completion does; one that only removes a queue entry
  does not (nor does it poke the live loop), and the next interval cycle sees the
  shorter queue. Either bumps the state version, so no cycle is skipped as
  unchanged. An allocation whose only outcome is its cancel (no complete event,
  inline runtime or walltime) runs until the cancel.

Speed: the mirror carries a scoring index (running GPU-hour sums, nodes held per
tenant, free nodes per dragonfly group; ``cost.ScoringIndex``) so that scoring need
not rescan the cluster in every decision, and one ``TopologyModel`` serves the whole
replay (node states, homes and capabilities never change here; owners are read
live), so the solver's per-model caches carry over from cycle to cycle.

Determinism: no wall clock in any decision, events ordered by (time, kind, sequence),
with the kinds at equal times in the order end, checkpoint done, arrival, cancel: an
allocation whose run ends at the cancel time ends on its own (the cancel finds it
ended); one whose checkpoint finishes then is requeued first and then removed; one
cancelled at its submit time arrives first and so is removed before any cycle (the
cycle runs after every event at that time) could start it. Every collection is built
in a fixed order; same inputs and seed -> the same result.
Wall time is measured (``time.perf_counter``) only for :class:`CycleStat.duration_s`
and ``wall_time_s``, which ``result.json`` leaves out.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Iterable, Mapping
from typing import Any

from lattice_common.assignment import check_assignment, check_preemption, is_sensitive
from lattice_common.errors import LatticeError, NotFound
from lattice_common.ledger import DEFAULT_BUDGET_PERIOD_DAYS
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Constraints,
    CostWeights,
    LifecycleType,
    Node,
    NodeState,
    ScalingSpec,
    SchedulerType,
    Tenant,
    VCluster,
)
from lattice_common.watch import StateMirror
from lattice_scheduler import autoscale
from lattice_scheduler.cost import gpu_hours
from lattice_scheduler.filters import node_satisfies
from lattice_scheduler.preemption import NEVER_PREEMPTED_CLASS, PreemptionPolicy
from lattice_scheduler.profiles import weights_as_mapping
from lattice_scheduler.topology import TopologyModel

from rm_replay import __version__
from rm_replay.inventory import build_nodes, inventory_summary
from rm_replay.model import (
    CancelEvent,
    CompleteEvent,
    CycleStat,
    Inventory,
    JobRecord,
    SimulationResult,
    SubmitEvent,
    TraceError,
    TraceEvent,
    UtilizationSample,
)
from rm_replay.policies import Decision, Placement, Policy, make_policy
from rm_replay.weights import ANY_VCLUSTER, weights_for

__all__ = ["DEFAULT_VCLUSTER", "Replay", "cancel_times", "jobs_from_events", "simulate"]

DEFAULT_VCLUSTER = "default"
INF = math.inf

# event kinds, in the order they are handled at equal times (module docstring)
_END = 0
_CHECKPOINT = 1
_ARRIVAL = 2
_CANCEL = 3
_SCALE = 4  # a reactive allocation's autoscaling evaluation
#: samples of a reactive allocation's metric kept for the decision's windows
_SAMPLES_KEPT = 64


class _ScoringIndex:
    """``lattice_scheduler.cost.ScoringIndex`` for the replay's mirror: the totals
    ``cost.build_context`` would otherwise rescan every allocation and node for, in
    every decision. The engine keeps them as it queues, assigns and releases (node
    states, capabilities and homes never change during a replay); the sums are added
    in the mirror's ``pending`` / ``holding`` order, as the scan adds them."""

    __slots__ = ("free_by_group", "held", "holding_hours", "pending_hours", "sums")

    def __init__(self, held_per_tenant: dict[str, int]) -> None:
        # (dragonfly group, home vCluster) -> free nodes: Ready, unowned, enabled
        self.free_by_group: dict[tuple[int, str], int] = {}
        # per allocation, cost.gpu_hours, in the order of m.pending / m.holding
        self.pending_hours: dict[str, float] = {}
        self.holding_hours: dict[str, float] = {}
        self.held = held_per_tenant  # the engine's tenant_busy
        self.sums: tuple[float, float] | None = None  # (queued, running), until a change

    def queue(self, a: Allocation) -> None:
        self.pending_hours[a.id] = gpu_hours(a)
        self.sums = None

    def unqueue(self, aid: str) -> None:
        del self.pending_hours[aid]
        self.sums = None

    def hold(self, a: Allocation, nodes: Mapping[str, Node]) -> None:
        self.holding_hours[a.id] = gpu_hours(a, nodes)
        self.sums = None

    def unhold(self, aid: str) -> None:
        del self.holding_hours[aid]
        self.sums = None

    def _sums(self) -> tuple[float, float]:
        if self.sums is None:
            queued = running = 0.0
            for x in self.pending_hours.values():
                queued += x
            for x in self.holding_hours.values():
                running += x
            self.sums = (queued, running)
        return self.sums

    def queued_gpu_hours(self) -> float:
        return self._sums()[0]

    def running_gpu_hours(self) -> float:
        return self._sums()[1]

    def held_nodes(self) -> Mapping[str, int]:
        return self.held

    def free_groups(self, vcluster: str | None) -> int:
        return len(
            {
                g
                for (g, home), n in self.free_by_group.items()
                if n and (vcluster is None or home in ("", vcluster))
            }
        )


class _ReplayMirror(StateMirror):
    """The replay's StateMirror, with the scoring index ``cost.build_context`` uses."""

    def __init__(self, held_per_tenant: dict[str, int]) -> None:
        super().__init__()
        self.scoring_index = _ScoringIndex(held_per_tenant)


class _Job:
    """One allocation's simulation state (the JobRecord is built from it at the end)."""

    __slots__ = (
        "acct_t",
        "alloc",
        "at_risk",
        "backfilled",
        "borrow_homes",
        "cancel_at",
        "checkpointable",
        "ckpt_att",
        "ckpt_ok",
        "conformance_fitness",
        "end",
        "ev",
        "exit",
        "first_start",
        "gen",
        "gpu_seconds",
        "gpus",
        "gpus_per_node",
        "groups_spanned",
        "key",
        "last_scale",
        "least",
        "lost_node_seconds",
        "node_seconds",
        "open_ended",
        "outcome",
        "preempted_at",
        "preempted_count",
        "released",
        "remaining",
        "run_ns0",
        "run_start",
        "runtime",
        "samples",
        "scale_downs",
        "scale_ups",
        "vc",
    )

    def __init__(
        self,
        ev: SubmitEvent,
        alloc: Allocation,
        runtime: float,
        exit_code: int,
        cancel_at: float | None = None,
        open_ended: bool = False,
    ) -> None:
        self.ev = ev
        self.alloc = alloc
        self.vc = alloc.spec.vcluster
        self.runtime = runtime
        self.remaining = runtime
        self.exit = exit_code
        # the trace's cancel time; open_ended: no outcome but the cancel (no end
        # event: it runs until the cancel)
        self.cancel_at = cancel_at
        self.open_ended = open_ended
        self.first_start: float | None = None
        self.run_start = 0.0
        self.released = 0.0  # when it last released its nodes
        self.end: float | None = None
        self.outcome = "unfinished"
        self.backfilled = False
        self.preempted_count = 0
        self.ckpt_att = 0
        self.ckpt_ok = 0
        self.gen = 0
        self.node_seconds = 0.0
        self.gpu_seconds = 0.0
        self.gpus = 0
        self.gpus_per_node = ev.gpus_per_node
        self.groups_spanned = 0
        self.conformance_fitness = 0.0
        self.preempted_at = 0.0
        self.borrow_homes: tuple[str, ...] = ()
        c = alloc.spec.constraints
        self.key = (c.gpu_type, c.gpu_count, c.memory_gb, tuple(c.features))
        # the fewest nodes it can start on (a node range may shrink to min_nodes)
        self.least = alloc.spec.min_nodes or max(1, alloc.spec.nodes)
        # node-seconds are settled up to acct_t (a reactive allocation's count changes)
        self.acct_t = 0.0
        self.run_ns0 = 0.0  # node_seconds when its current run started
        self.at_risk = 0.0  # node-seconds of its current run, at its preemption
        self.lost_node_seconds = 0.0
        self.checkpointable = ev.checkpoint != "none"
        self.samples: list[autoscale.Sample] = []
        self.last_scale: float | None = None
        self.scale_ups = 0
        self.scale_downs = 0


def cancel_times(events: Iterable[TraceEvent]) -> dict[str, float]:
    """Allocation id -> the time of its cancel event. A cancel of an allocation the
    events never submit, or submit only after the cancel, or a second cancel, is a
    :class:`TraceError` (``trace.check_trace`` names the line when loading a file)."""
    submitted: dict[str, float] = {}
    cancels: list[CancelEvent] = []
    for ev in events:
        if isinstance(ev, SubmitEvent):
            submitted.setdefault(ev.id, ev.t)
        elif isinstance(ev, CancelEvent):
            cancels.append(ev)
    out: dict[str, float] = {}
    for c in cancels:
        if c.id not in submitted:
            raise TraceError(f"cancel of allocation {c.id!r}, which the trace never submits")
        if c.t < submitted[c.id]:
            raise TraceError(f"allocation {c.id!r} is cancelled before its submission")
        if c.id in out:
            raise TraceError(f"allocation {c.id!r} is cancelled twice")
        out[c.id] = c.t
    return out


def jobs_from_events(
    events: Iterable[TraceEvent],
    *,
    default_vcluster: str = DEFAULT_VCLUSTER,
    cancels: Mapping[str, float] | None = None,
) -> list[tuple[SubmitEvent, Allocation, float, int]]:
    """(submit, Pending allocation, actual runtime, exit) per submission, in arrival
    order (submit time, then trace order). Complete events supply runtime and exit
    (wherever they are in the trace; one for an allocation never submitted is
    ignored); without one the submit's inline runtime, else the walltime, else, for
    an allocation with a cancel event, the time from its submission to the cancel
    (it runs until cancelled). ``cancels``: :func:`cancel_times` of ``events`` when the
    caller has it."""
    events = list(events)
    submits: dict[str, SubmitEvent] = {}
    order: dict[str, int] = {}
    completes: dict[str, CompleteEvent] = {}
    for i, ev in enumerate(events):
        if isinstance(ev, SubmitEvent):
            if ev.id in submits:
                raise TraceError(f"allocation {ev.id!r} is submitted twice")
            submits[ev.id] = ev
            order[ev.id] = i
        elif isinstance(ev, CompleteEvent):
            completes[ev.id] = ev  # matched below; one with no submit is ignored
        elif not isinstance(ev, CancelEvent):  # pragma: no cover - typed input
            raise TypeError(f"not a trace event: {ev!r}")
    if cancels is None:
        cancels = cancel_times(events)
    out: list[tuple[SubmitEvent, Allocation, float, int]] = []
    for aid in sorted(submits, key=lambda x: (submits[x].t, order[x])):
        ev = submits[aid]
        done = completes.get(aid)
        if done is not None:
            runtime, exit_code = done.duration, done.exit
        elif ev.runtime is not None:
            runtime, exit_code = ev.runtime, ev.exit
        elif ev.walltime > 0:
            runtime, exit_code = ev.walltime, ev.exit
        elif aid in cancels:
            runtime, exit_code = cancels[aid] - ev.t, ev.exit
        else:
            raise TraceError(
                f"allocation {aid!r} has no runtime: no complete event, no inline runtime "
                "and no walltime",
                hint='Add a complete event with "duration", a "runtime" in the submit, or a walltime.',
            )
        walltime = math.ceil(ev.walltime) if ev.walltime > 0 else 0
        lifecycle = LifecycleType.BOUNDED if walltime else LifecycleType.UNBOUNDED
        if ev.reactive:
            lifecycle = LifecycleType.REACTIVE
        ck_mode, ck_protocol = "none", ""  # not said: as before the field existed
        if ev.checkpoint in ("signal", "shmem", "grpc"):
            ck_mode, ck_protocol = "auto", ev.checkpoint
        elif ev.checkpoint in ("auto", "manual"):
            ck_mode, ck_protocol = ev.checkpoint, "signal"
        spec = AllocationSpec(
            entrypoint="rm-replay",
            tenant=ev.tenant,
            vcluster=ev.vcluster or default_vcluster,
            nodes=max(1, ev.nodes),
            min_nodes=ev.min_nodes if 0 < ev.min_nodes < ev.nodes else 0,
            walltime_seconds=walltime,
            lifecycle=lifecycle,
            preemption_class=10 if ev.sensitive else ev.preemption_class,
            checkpoint=ck_mode,
            checkpoint_protocol=ck_protocol,
            scaling=(ev.scaling or ScalingSpec()) if ev.reactive else None,
            name=ev.name,
            user=ev.user,
            constraints=Constraints(
                gpu_type=ev.gpu_type,
                gpu_count=ev.gpus_per_node,
                features=list(ev.features),
                memory_gb=ev.memory_gb,
                topology=ev.topology,
            ),
        )
        alloc = Allocation(id=aid, spec=spec, submitted_at=ev.t)
        out.append((ev, alloc, float(runtime), int(exit_code)))
    return out


class Replay:
    """One replay (see the module docstring); :meth:`run` returns the result."""

    def __init__(
        self,
        trace_events: Iterable[TraceEvent],
        inventory: Inventory,
        *,
        policy: str | Policy = "lattice",
        weights_by_vcluster: Mapping[str, CostWeights] | None = None,
        cycle_interval: float = 30.0,
        schedule_on_arrival: bool = True,
        backfill_depth: int = 10,
        seed: int = 0,
        checkpoint_success_rate: float = 0.98,
        checkpoint_seconds: float = 60.0,
        sample_interval: float = 300.0,
        default_vcluster: str | None = None,
        max_time: float | None = None,
        trace_name: str = "",
        preemption_policy: PreemptionPolicy | None = None,
        skip_unchanged_cycles: bool = True,
        budget_period_days: float = DEFAULT_BUDGET_PERIOD_DAYS,
        checkpoint_broker: bool = True,
    ) -> None:
        if not cycle_interval > 0:
            raise ValueError("cycle_interval must be > 0")
        if not sample_interval > 0:
            raise ValueError("sample_interval must be > 0")
        if not 0.0 <= checkpoint_success_rate <= 1.0:
            raise ValueError("checkpoint_success_rate must be within [0, 1]")
        if not checkpoint_seconds >= 0:
            raise ValueError("checkpoint_seconds must be >= 0")
        if backfill_depth < 0:
            raise ValueError("backfill_depth must be >= 0")
        weights = dict(weights_by_vcluster or {})
        if default_vcluster is None:
            named = [k for k in weights if k != ANY_VCLUSTER]
            default_vcluster = named[0] if len(named) == 1 else DEFAULT_VCLUSTER
        self.default_vcluster = default_vcluster
        self.policy: Policy = (
            make_policy(
                policy,
                preemption_policy=preemption_policy,
                budget_period_days=budget_period_days,
            )
            if isinstance(policy, str)
            else policy
        )
        self.weights = weights
        self.budget_period_days = budget_period_days
        self.cycle_interval = float(cycle_interval)
        self.schedule_on_arrival = schedule_on_arrival
        self.backfill_depth = backfill_depth
        self.seed = seed
        self.checkpoint_success_rate = checkpoint_success_rate
        self.checkpoint_seconds = float(checkpoint_seconds)
        self.checkpoint_broker = checkpoint_broker
        self.sample_interval = float(sample_interval)
        self.max_time = max_time
        self.trace_name = trace_name
        self.inventory = inventory

        # --- the cluster
        self.tenant_busy: dict[str, int] = {}
        m = self.m = _ReplayMirror(self.tenant_busy)
        m.nodes = build_nodes(inventory)
        self.index = m.scoring_index
        self.topology = TopologyModel.from_nodes(m.nodes)
        self.home_pools = frozenset(n.home_vcluster for n in m.nodes.values())
        self.total_nodes = len(m.nodes)
        self.total_gpus = sum(n.capabilities.gpu_count for n in m.nodes.values())
        self.sig_of = self.topology.node_signature
        self.rep: dict[int, Node] = {}
        self.free_cells: dict[tuple[int, str], int] = {}
        for nid, n in m.nodes.items():
            s = self.sig_of[nid]
            self.rep.setdefault(s, n)
            if n.state == NodeState.READY and not n.disabled:
                cell = (s, n.home_vcluster)
                self.free_cells[cell] = self.free_cells.get(cell, 0) + 1
                if not n.owner:
                    gcell = (n.group, n.home_vcluster)
                    free_by_group = self.index.free_by_group
                    free_by_group[gcell] = free_by_group.get(gcell, 0) + 1

        # --- the workload
        trace_events = list(trace_events)
        cancels = cancel_times(trace_events)
        entries = jobs_from_events(trace_events, default_vcluster=default_vcluster, cancels=cancels)
        completed = {ev.id for ev in trace_events if isinstance(ev, CompleteEvent)}
        self.jobs: dict[str, _Job] = {}
        for ev, alloc, runtime, exit_code in entries:
            cancel_at = cancels.get(alloc.id)
            open_ended = (
                cancel_at is not None
                and alloc.id not in completed
                and ev.runtime is None
                and ev.walltime <= 0
            )
            self.jobs[alloc.id] = _Job(ev, alloc, runtime, exit_code, cancel_at, open_ended)
        self.arrival_order = [alloc.id for _, alloc, _, _ in entries]

        # --- tenants and vClusters
        specs = {t.name: t for t in inventory.tenants}
        names = sorted({j.alloc.spec.tenant for j in self.jobs.values()} | set(specs))
        fixed = sum(
            t.fair_share_target or 0.0 for t in specs.values() if t.fair_share_target is not None
        )
        free_names = [n for n in names if n not in specs or specs[n].fair_share_target is None]
        rest = max(0.0, 1.0 - fixed) / len(free_names) if free_names else 0.0
        for name in names:
            t = specs.get(name)
            share = rest if t is None or t.fair_share_target is None else t.fair_share_target
            m.tenants[name] = Tenant(
                name=name,
                fair_share_target=share,
                burst_allowance=0.0 if t is None else t.burst_allowance,
                max_nodes=None if t is None else t.max_nodes,
                max_concurrent_allocations=None if t is None else t.max_concurrent_allocations,
                gpu_hours_budget=None if t is None else t.gpu_hours_budget,
                node_hours_budget=None if t is None else t.node_hours_budget,
            )
        self.keep_history = any(
            t.gpu_hours_budget is not None or t.node_hours_budget is not None
            for t in m.tenants.values()
        )
        vspecs = {v.name: v for v in inventory.vclusters}
        vc_names = sorted({j.vc for j in self.jobs.values()} | set(vspecs) | {default_vcluster})
        for name in vc_names:
            vs = vspecs.get(name)
            m.vclusters[name] = VCluster(
                name=name,
                scheduler_type=SchedulerType(vs.scheduler_type)
                if vs
                else SchedulerType.HPC_BACKFILL,
                weights=weights_for(name, weights),
                backfill_depth=(
                    vs.backfill_depth
                    if vs is not None and vs.backfill_depth is not None
                    else backfill_depth
                ),
                allow_borrowing=True if vs is None else vs.allow_borrowing,
            )

        # --- indexes for deciding when a cycle can change anything
        self.pending_keys: dict[str, dict[tuple[object, ...], dict[int, int]]] = {}
        self.pending_classes: dict[str, dict[int, int]] = {}
        self.running_classes: dict[int, int] = {}
        self.borrowers_on: dict[str, int] = {}
        self.match_cache: dict[tuple[object, ...], frozenset[int]] = {}
        self.key_spec: dict[tuple[object, ...], AllocationSpec] = {}

        # --- accounting
        self.busy_nodes = 0
        self.busy_gpus = 0
        self.running = 0
        self.samples: list[UtilizationSample] = []
        self.cycles: list[CycleStat] = []
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.rejected = 0
        self.preemptions = 0
        self.poked = False
        # state version, bumped by every change but an arrival; arrivals per decision
        # scope (vCluster, or None for the whole queue); per scope, the last decision
        # that changed nothing: (version, arrivals seen, critical order)
        self.version = 0
        self.changes = 0  # every change, arrivals included
        self.arrivals: dict[str | None, list[str]] = {}
        self.noop: dict[str | None, tuple[int, int, tuple[str, ...]]] = {}
        self.skipped_unchanged = 0
        self.skip_unchanged = skip_unchanged_cycles

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, aid: str, gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, aid, gen))

    def run(self) -> SimulationResult:
        wall0 = time.perf_counter()
        for aid in self.arrival_order:
            self._push(self.jobs[aid].alloc.submitted_at, _ARRIVAL, aid)
        for aid in self.arrival_order:
            cancel_at = self.jobs[aid].cancel_at
            if cancel_at is not None:
                self._push(cancel_at, _CANCEL, aid)
        start = self.heap[0][0] if self.heap else 0.0
        self.start_time = start
        next_sample_k = 0
        next_tick = start  # the loop's timer runs from the start of the replay
        last_cycle_changes = -1
        t = start
        heap = self.heap
        jobs = self.jobs
        while True:
            # a cancel of an allocation that already ended does nothing, nor do the end
            # and checkpoint events of a cancelled one: drop them rather than let them
            # carry the replay (and its samples) on to their time
            while heap and (
                (heap[0][1] == _CANCEL and jobs[heap[0][3]].end is not None)
                or (heap[0][1] != _ARRIVAL and jobs[heap[0][3]].outcome == "cancelled")
            ):
                heapq.heappop(heap)
            t_ev = heap[0][0] if heap else INF
            # interval cycles while work is pending; once no event is left (nothing
            # runs), one more for arrivals no cycle has seen, then the replay is over
            pending = bool(self.m.pending)
            idle = not heap and self.changes == last_cycle_changes
            t_tick = next_tick if pending and not idle else INF
            t_next = t_ev if t_ev <= t_tick else t_tick
            if t_next == INF:
                break
            if self.max_time is not None and t_next > self.max_time:
                t = max(t, self.max_time)
                break
            t = t_next
            while True:  # samples strictly before t see the state before t's events
                ts = start + next_sample_k * self.sample_interval
                if ts >= t:
                    break
                self._sample(ts)
                next_sample_k += 1
            self.poked = False
            while heap and heap[0][0] == t:
                _, kind, _, aid, gen = heapq.heappop(heap)
                if kind == _ARRIVAL:
                    self._arrive(t, aid)
                elif kind == _END:
                    self._end(t, aid, gen)
                elif kind == _CHECKPOINT:
                    self._checkpoint_done(t, aid, gen)
                elif kind == _SCALE:
                    self._scale(t, aid, gen)
                else:
                    self._cancel(t, aid)
            if next_tick < t:  # interval cycles passed while nothing was pending
                next_tick += math.ceil((t - next_tick) / self.cycle_interval) * self.cycle_interval
            if self.poked or t >= next_tick:
                self._cycle(t)
                last_cycle_changes = self.changes
                next_tick = t + self.cycle_interval
        end = t
        self.end_time = end
        while True:
            ts = start + next_sample_k * self.sample_interval
            if ts > end:
                break
            self._sample(ts)
            next_sample_k += 1
        result = self._result()
        result.wall_time_s = time.perf_counter() - wall0
        return result

    def _arrive(self, t: float, aid: str) -> None:
        job = self.jobs[aid]
        a = job.alloc
        self.m.allocations[aid] = a
        self.arrivals.setdefault(job.vc if self.policy.per_vcluster else None, []).append(aid)
        self.changes += 1
        self._enqueue(job)
        # the live loop pokes for new work only while some node is free; on a full
        # cluster new work waits for freed capacity or the interval cycle
        if self.schedule_on_arrival and any(self.free_cells.values()):
            self.poked = True

    def _enqueue(self, job: _Job) -> None:
        a = job.alloc
        self.m.pending[a.id] = None
        self.index.queue(a)
        keys = self.pending_keys.setdefault(job.vc, {})
        sizes = keys.setdefault(job.key, {})
        self.key_spec.setdefault(job.key, a.spec)
        k = job.least
        sizes[k] = sizes.get(k, 0) + 1
        classes = self.pending_classes.setdefault(job.vc, {})
        c = a.spec.preemption_class
        classes[c] = classes.get(c, 0) + 1

    def _dequeue(self, job: _Job) -> None:
        a = job.alloc
        del self.m.pending[a.id]
        self.index.unqueue(a.id)
        keys = self.pending_keys[job.vc]
        sizes = keys[job.key]
        k = job.least
        sizes[k] -= 1
        if not sizes[k]:
            del sizes[k]
            if not sizes:
                del keys[job.key]
        classes = self.pending_classes[job.vc]
        c = a.spec.preemption_class
        classes[c] -= 1
        if not classes[c]:
            del classes[c]

    def _schedule_end(self, t: float, job: _Job) -> None:
        if job.open_ended:
            return  # no outcome but its cancel (and no walltime): it runs until then
        w = job.alloc.spec.walltime_seconds
        run = w if (w > 0 and job.remaining > w) else job.remaining
        self._push(t + run, _END, job.alloc.id, job.gen)

    def _end(self, t: float, aid: str, gen: int) -> None:
        job = self.jobs[aid]
        a = job.alloc
        if gen != job.gen or a.state not in (
            AllocationState.RUNNING,
            AllocationState.CHECKPOINTING,
        ):
            return  # superseded (requeued after a checkpoint)
        w = a.spec.walltime_seconds
        if w > 0 and job.remaining > w:
            outcome, state = "walltime_exceeded", AllocationState.FAILED
        elif job.exit == 0:
            outcome, state = "completed", AllocationState.COMPLETED
        else:
            outcome, state = "failed", AllocationState.FAILED
        was_running = a.state == AllocationState.RUNNING
        self.version += 1
        self.changes += 1
        self._release(t, job, was_running=was_running)
        a.state = state
        a.finished_at = t
        a.exit_code = job.exit if outcome != "walltime_exceeded" else None
        a.reason = outcome if outcome != "completed" else ""
        del self.m.holding[aid]
        self.index.unhold(aid)
        if not self.keep_history:
            del self.m.allocations[aid]
        job.gen += 1
        job.end = t
        job.outcome = outcome
        self.running -= 1
        self.poked = True

    def _checkpoint_done(self, t: float, aid: str, gen: int) -> None:
        job = self.jobs[aid]
        a = job.alloc
        if gen != job.gen or a.state != AllocationState.CHECKPOINTING:
            return  # it ended during its checkpoint
        self.version += 1
        self.changes += 1
        saved = False
        if self._checkpoints(job):
            job.ckpt_att += 1
            rng = random.Random(f"{self.seed}:{aid}:{job.ckpt_att}")
            saved = rng.random() < self.checkpoint_success_rate
        if saved:
            job.ckpt_ok += 1
            job.remaining = max(0.0, job.remaining - (job.preempted_at - job.run_start))
        else:  # stopped without a usable checkpoint: its run's work is done again
            job.lost_node_seconds += job.at_risk
        self._release(t, job, was_running=False)
        a.state = AllocationState.PENDING
        a.assigned_nodes = []
        a.started_at = None
        a.preempted_count += 1
        a.resume_from_checkpoint = True
        a.reason = "preempted"
        del self.m.holding[aid]
        self.index.unhold(aid)
        self._enqueue(job)
        job.preempted_count += 1
        job.gen += 1
        self.running -= 1
        self.poked = True

    def _cancel(self, t: float, aid: str) -> None:
        """The trace's cancel: a Pending allocation leaves the queue; a running (or
        checkpointing) one ends now, its nodes freed; an ended one is left alone."""
        job = self.jobs[aid]
        a = job.alloc
        if job.end is not None or aid not in self.m.allocations:
            return  # already ended (or, impossibly, not arrived)
        self.version += 1
        self.changes += 1
        if a.state == AllocationState.PENDING:
            self._dequeue(job)
            # end: when it last released nodes (before a preemption), else the cancel.
            # No poke: nothing was freed, and the live loop is not poked for a
            # cancelled queue entry either; the next cycle sees the shorter queue.
            job.end = t if job.first_start is None else job.released
        elif a.state in (AllocationState.RUNNING, AllocationState.CHECKPOINTING):
            self._release(t, job, was_running=a.state == AllocationState.RUNNING)
            del self.m.holding[aid]
            self.index.unhold(aid)
            self.running -= 1
            job.end = t
            self.poked = True  # freed nodes: the live loop's poke, as for a completion
        else:  # pragma: no cover - the replay has no other live states
            return
        a.state = AllocationState.CANCELLED
        a.finished_at = t
        a.exit_code = None
        a.reason = "cancelled"
        if not self.keep_history:
            del self.m.allocations[aid]
        job.gen += 1  # its end / checkpoint events are void now
        job.outcome = "cancelled"

    # ------------------------------------------------------------------ nodes

    def _release(self, t: float, job: _Job, *, was_running: bool) -> None:
        a = job.alloc
        nodes = self.m.nodes
        job.released = t
        dt = t - job.acct_t
        job.acct_t = t
        job.node_seconds += dt * len(a.assigned_nodes)
        job.gpu_seconds += dt * job.gpus
        for nid in a.assigned_nodes:
            n = nodes[nid]
            if n.owner == a.id:
                n.owner = ""
                n.owner_tenant = ""
                n.owner_vcluster = ""
                if n.state == NodeState.READY and not n.disabled:
                    cell = (self.sig_of[nid], n.home_vcluster)
                    self.free_cells[cell] += 1
                    gcell = (n.group, n.home_vcluster)
                    free_by_group = self.index.free_by_group
                    free_by_group[gcell] = free_by_group.get(gcell, 0) + 1
        self.busy_nodes -= len(a.assigned_nodes)
        self.busy_gpus -= job.gpus
        tenant = a.spec.tenant
        left = self.tenant_busy[tenant] - len(a.assigned_nodes)
        if left:
            self.tenant_busy[tenant] = left
        else:
            del self.tenant_busy[tenant]
        if was_running:
            self._not_running(job)

    def _not_running(self, job: _Job) -> None:
        c = job.alloc.spec.preemption_class
        self.running_classes[c] -= 1
        if not self.running_classes[c]:
            del self.running_classes[c]
        for h in job.borrow_homes:
            self.borrowers_on[h] -= 1
        job.borrow_homes = ()

    def _node(self, node_id: str) -> Node:
        n = self.m.nodes.get(node_id)
        if n is None:
            raise NotFound(f"node {node_id} not found")
        return n

    def _tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(nodes, allocations) ``tenant`` holds, as the quorum counts them."""
        allocs = self.m.allocations
        held = sum(1 for i in self.m.holding if allocs[i].spec.tenant == tenant)
        return self.tenant_busy.get(tenant, 0), held

    def _assign(self, t: float, p: Placement) -> bool:
        """``AssignNodes``: the quorum's checks (``lattice_common.assignment``), then
        the allocation runs. Rejections are counted, as the live loop's are logged."""
        job = self.jobs.get(p.allocation_id)
        if job is None:
            self.rejected += 1
            return False
        a = job.alloc
        m = self.m
        try:
            chosen = check_assignment(
                a,
                p.node_ids,
                self._node,
                sensitive=is_sensitive(a, m.vclusters),
                tenant=m.tenants.get(a.spec.tenant),
                tenant_usage=lambda: self._tenant_usage(a.spec.tenant),
            )
        except LatticeError:
            self.rejected += 1
            return False
        self.version += 1
        self.changes += 1
        vc = p.vcluster or a.spec.vcluster
        gpus = 0
        homes: set[str] = set()
        for n in chosen:
            n.owner = a.id
            n.owner_tenant = a.spec.tenant
            n.owner_vcluster = vc
            gpus += n.capabilities.gpu_count
            if not n.disabled:
                self.free_cells[(self.sig_of[n.id], n.home_vcluster)] -= 1
                self.index.free_by_group[(n.group, n.home_vcluster)] -= 1
            if n.home_vcluster not in ("", a.spec.vcluster):
                homes.add(n.home_vcluster)
        a.assigned_nodes = list(p.node_ids)
        a.state = AllocationState.RUNNING
        a.started_at = t
        a.pending_reason = ""
        a.preempted_by = ""
        a.reason = ""
        self._dequeue(job)
        self.m.holding[a.id] = None
        self.index.hold(a, self.m.nodes)
        c = a.spec.preemption_class
        self.running_classes[c] = self.running_classes.get(c, 0) + 1
        job.borrow_homes = tuple(sorted(homes))
        for h in job.borrow_homes:
            self.borrowers_on[h] = self.borrowers_on.get(h, 0) + 1
        k = len(chosen)
        job.gpus = gpus
        job.gpus_per_node = gpus // k if k else 0
        job.run_start = t
        job.acct_t = t
        job.run_ns0 = job.node_seconds
        if job.first_start is None:
            job.first_start = t
            job.backfilled = p.backfilled
            job.groups_spanned = p.groups_spanned
            job.conformance_fitness = p.conformance_fitness
        if a.spec.lifecycle == LifecycleType.REACTIVE:  # its autoscaling, from its start
            job.samples, job.last_scale = [], None
            interval = (a.spec.scaling or ScalingSpec()).evaluation_interval
            self._push(t + interval, _SCALE, a.id, job.gen)
        self.busy_nodes += k
        self.busy_gpus += gpus
        self.tenant_busy[a.spec.tenant] = self.tenant_busy.get(a.spec.tenant, 0) + k
        self.running += 1
        self._schedule_end(t, job)
        return True

    def _preempt(self, t: float, victim_id: str, preemptor_id: str) -> bool:
        """``PreemptAllocation``: the quorum's checks (``lattice_common.assignment``),
        then the victim checkpoints."""
        v = self.jobs.get(victim_id)
        p = self.jobs.get(preemptor_id)
        if v is None or p is None:
            return False
        a, pa = v.alloc, p.alloc
        try:
            check_preemption(a, pa, self.m.nodes)
        except LatticeError:
            return False
        self.version += 1
        self.changes += 1
        a.state = AllocationState.CHECKPOINTING
        a.preempted_by = pa.id
        a.reason = "preempted"
        self._not_running(v)
        v.preempted_at = t
        v.at_risk = v.node_seconds + (t - v.acct_t) * len(a.assigned_nodes) - v.run_ns0
        # without a checkpoint the victim is stopped at once (SIGTERM)
        wait = self.checkpoint_seconds if self._checkpoints(v) else 0.0
        self._push(t + wait, _CHECKPOINT, victim_id, v.gen)
        self.preemptions += 1
        return True

    def _checkpoints(self, job: _Job) -> bool:
        """A preempted ``job`` is asked to checkpoint (the broker runs and it declared
        a way to) rather than stopped."""
        return self.checkpoint_broker and job.checkpointable

    # ------------------------------------------------------------------ autoscaling

    def _load(self, job: _Job, t: float) -> float:
        """A reactive allocation's metric at ``t`` (its load profile, a step function
        of the time since its submission)."""
        value = job.ev.load[0][1] if job.ev.load else 0.0
        since = t - job.alloc.submitted_at
        for at, v in job.ev.load:
            if at > since:
                break
            value = v
        return value

    def _free_node_for(self, job: _Job) -> Node | None:
        """The node a scale-up takes: the first free, Ready node by id in the
        allocation's pool (its vCluster's or the shared one) that meets its hard
        constraints."""
        a = job.alloc
        for nid in sorted(self.m.nodes):
            n = self.m.nodes[nid]
            if (
                not n.owner
                and n.state == NodeState.READY
                and not n.disabled
                and n.home_vcluster in ("", a.spec.vcluster)
                and node_satisfies(n, a.spec)
            ):
                return n
        return None

    def _scale(self, t: float, aid: str, gen: int) -> None:
        job = self.jobs[aid]
        a = job.alloc
        if gen != job.gen or a.state != AllocationState.RUNNING:
            return  # ended, preempted or requeued since: its next run schedules its own
        spec = a.spec.scaling or ScalingSpec()
        self._push(t + spec.evaluation_interval, _SCALE, aid, job.gen)
        homes = {nid: self.m.nodes[nid].home_vcluster for nid in a.assigned_nodes}
        wanted = {self.jobs[p].vc for p in self.m.pending}
        back = autoscale.reclaimed_node(a.assigned_nodes, homes, a.spec.vcluster, wanted)
        if back:  # its home vCluster has work waiting: given back, as the live autoscaler
            self._resize(t, job, drop=self.m.nodes[back])
            job.scale_downs += 1
            job.last_scale = t
            job.samples.clear()
            self.poked = True
            return
        job.samples.append(autoscale.Sample(t, self._load(job, t)))
        del job.samples[:-_SAMPLES_KEPT]
        tenant = self.m.tenants.get(a.spec.tenant)
        quota = None
        if tenant is not None and tenant.max_nodes is not None:
            quota = (tenant.name, self.tenant_busy.get(tenant.name, 0), tenant.max_nodes)
        node = self._free_node_for(job)
        since = job.run_start if job.last_scale is None else max(job.run_start, job.last_scale)
        state = autoscale.ScalingState(
            samples=tuple(job.samples),
            current=len(a.assigned_nodes),
            min_nodes=a.spec.min_nodes,
            max_nodes=a.spec.nodes,
            last_event_at=since,
            quota=quota,
            free_nodes=1 if node is not None else 0,
        )
        d = autoscale.decide(state, spec, t)
        if d.action == autoscale.SCALE_UP and node is not None:
            self._resize(t, job, add=node)
            job.scale_ups += 1
        elif d.action == autoscale.SCALE_DOWN and len(a.assigned_nodes) > 1:
            self._resize(t, job, drop=self.m.nodes[a.assigned_nodes[-1]])
            job.scale_downs += 1
            self.poked = True  # a freed node, as for a completion
        else:
            return
        job.last_scale = t
        job.samples.clear()  # a new size: the windows start again

    def _resize(
        self, t: float, job: _Job, *, add: Node | None = None, drop: Node | None = None
    ) -> None:
        """``ScaleAllocation`` of one node, with the engine's books kept."""
        a = job.alloc
        job.node_seconds += (t - job.acct_t) * len(a.assigned_nodes)
        job.gpu_seconds += (t - job.acct_t) * job.gpus
        job.acct_t = t
        self.version += 1
        self.changes += 1
        self.index.unhold(a.id)
        n = add or drop
        assert n is not None
        cell = (self.sig_of[n.id], n.home_vcluster)
        gcell = (n.group, n.home_vcluster)
        tenant = a.spec.tenant
        if add is not None:
            n.owner, n.owner_tenant, n.owner_vcluster = a.id, tenant, a.spec.vcluster
            self.free_cells[cell] -= 1
            self.index.free_by_group[gcell] -= 1
            a.assigned_nodes = [*a.assigned_nodes, n.id]
            step = 1
        else:
            n.owner = n.owner_tenant = n.owner_vcluster = ""
            self.free_cells[cell] += 1
            self.index.free_by_group[gcell] = self.index.free_by_group.get(gcell, 0) + 1
            a.assigned_nodes = [x for x in a.assigned_nodes if x != n.id]
            step = -1
        gpus = n.capabilities.gpu_count * step
        job.gpus += gpus
        self.busy_nodes += step
        self.busy_gpus += gpus
        self.tenant_busy[tenant] = self.tenant_busy.get(tenant, 0) + step
        self.index.hold(a, self.m.nodes)

    # ------------------------------------------------------------------ cycles

    def _matching(self, key: tuple[object, ...]) -> frozenset[int]:
        """Capability signatures whose nodes the policy's filter accepts for ``key``."""
        sigs = self.match_cache.get(key)
        if sigs is None:
            spec = self.key_spec[key]
            sigs = self.match_cache[key] = frozenset(
                s for s, n in sorted(self.rep.items()) if self.policy.node_filter(n, spec)
            )
        return sigs

    def _fits_count(self, vc: str, key: tuple[object, ...], need: int) -> bool:
        """At least ``need`` free nodes that match ``key`` in pools ``vc`` may use
        (its own, the shared one, and any other when it may borrow)."""
        v = self.m.vclusters.get(vc)
        borrow = self.policy.borrows and (v is None or v.allow_borrowing)
        sigs = self._matching(key)
        free = 0
        for (s, home), count in self.free_cells.items():
            if count and s in sigs and (home in ("", vc) or borrow):
                free += count
                if free >= need:
                    return True
        return False

    def _could_place(self, vc: str) -> bool:
        """Some pending allocation of ``vc`` has enough free matching nodes
        (:meth:`_fits_count`). When none has, no policy can place one."""
        keys = self.pending_keys.get(vc)
        if not keys:
            return False
        return any(self._fits_count(vc, key, min(sizes)) for key, sizes in keys.items())

    def _could_preempt(self, vc: str) -> bool:
        """A pending class above a running one, or a borrower on ``vc``'s pool."""
        if self.borrowers_on.get(vc):
            return True
        classes = self.pending_classes.get(vc)
        if not classes or not self.running_classes:
            return False
        return max(classes) > min(self.running_classes)

    def _unchanged(self, key: str | None, t: float) -> bool:
        """Deciding now provably places nothing: since ``key``'s last decision, which
        placed nothing, the state changed only by arrivals, none of which has as many
        free matching nodes as it needs, and the queue still starts with that
        decision's critical order (see :class:`rm_replay.policies.Decision`). Not
        used when a preemption is possible (victim choice depends on the time)."""
        memo = self.noop.get(key)
        if not self.skip_unchanged or memo is None or memo[0] != self.version:
            return False
        _, seen, critical = memo
        for aid in self.arrivals.get(key, ())[seen:]:
            job = self.jobs[aid]
            if self._fits_count(job.vc, job.key, job.least):
                return False
        if not critical:
            return True
        order = self.policy.queue_order(self.m, t, vcluster=key)
        return order[: len(critical)] == critical

    def _decide(self, key: str | None, t: float, *, preemptible: bool) -> tuple[int, int, int]:
        before = self.version
        d = self.policy.decide(
            self.m, t, vcluster=key, topology=self.topology, home_pools=self.home_pools
        )
        done = self._apply(t, d)
        if (
            self.skip_unchanged
            and self.version == before
            and not preemptible
            and d.critical_order is not None
        ):
            seen = len(self.arrivals.get(key, ()))
            self.noop[key] = (self.version, seen, d.critical_order)
        else:
            self.noop.pop(key, None)
        return done

    def _cycle(self, t: float) -> None:
        m = self.m
        if not m.pending:
            return
        vcs = sorted(vc for vc, keys in self.pending_keys.items() if keys)
        queued = len(m.pending)
        placed = backfilled = preempted = 0
        ran = False
        t0 = time.perf_counter()
        if self.policy.per_vcluster:
            for vc in vcs:
                preemptible = self.policy.preempts and self._could_preempt(vc)
                if self.skip_unchanged and not (self._could_place(vc) or preemptible):
                    continue
                if not preemptible and self._unchanged(vc, t):
                    self.skipped_unchanged += 1
                    continue
                ran = True
                p, b, x = self._decide(vc, t, preemptible=preemptible)
                placed, backfilled, preempted = placed + p, backfilled + b, preempted + x
        elif not self.skip_unchanged or any(self._could_place(vc) for vc in vcs):
            if self._unchanged(None, t):
                self.skipped_unchanged += 1
            else:
                ran = True
                placed, backfilled, preempted = self._decide(None, t, preemptible=False)
        if ran:
            self.cycles.append(
                CycleStat(
                    t=t,
                    pending=queued,
                    placed=placed,
                    backfilled=backfilled,
                    preempted=preempted,
                    duration_s=time.perf_counter() - t0,
                )
            )

    def _apply(self, t: float, d: Decision) -> tuple[int, int, int]:
        placed = backfilled = preempted = 0
        for p in d.placements:
            if self._assign(t, p):
                placed += 1
                backfilled += p.backfilled
        for victim, preemptor in d.preemptions:
            preempted += self._preempt(t, victim, preemptor)
        return placed, backfilled, preempted

    # ------------------------------------------------------------------ output

    def _sample(self, t: float) -> None:
        self.samples.append(
            UtilizationSample(
                t=t,
                busy_nodes=self.busy_nodes,
                busy_gpus=self.busy_gpus,
                total_nodes=self.total_nodes,
                total_gpus=self.total_gpus,
                per_tenant_busy_nodes=dict(sorted(self.tenant_busy.items())),
                pending=len(self.m.pending),
                running=self.running,
            )
        )

    def _result(self) -> SimulationResult:
        records: list[JobRecord] = []
        last_end = None
        end = self.end_time
        for aid in self.arrival_order:
            job = self.jobs[aid]
            a = job.alloc
            if aid not in self.m.allocations and job.end is None:
                continue  # never arrived (stopped at max_time)
            node_s, gpu_s = job.node_seconds, job.gpu_seconds
            if job.end is None and a.state in (
                AllocationState.RUNNING,
                AllocationState.CHECKPOINTING,
            ):
                node_s += (end - job.acct_t) * len(a.assigned_nodes)
                gpu_s += (end - job.acct_t) * job.gpus
            if job.end is not None and job.first_start is not None:  # ran: did work
                last_end = job.end if last_end is None else max(last_end, job.end)
            ev = job.ev
            records.append(
                JobRecord(
                    id=aid,
                    tenant=a.spec.tenant,
                    user=a.spec.user,
                    vcluster=a.spec.vcluster,
                    preemption_class=a.spec.preemption_class,
                    nodes=a.spec.nodes,
                    gpus_per_node=job.gpus_per_node,
                    submit=a.submitted_at,
                    start=job.first_start,
                    end=job.end,
                    walltime=float(a.spec.walltime_seconds),
                    runtime=job.runtime,
                    state=job.outcome,
                    backfilled=job.backfilled,
                    preempted_count=job.preempted_count,
                    checkpoints_attempted=job.ckpt_att,
                    checkpoints_succeeded=job.ckpt_ok,
                    sensitive=ev.sensitive or a.spec.preemption_class >= NEVER_PREEMPTED_CLASS,
                    gpu_type=ev.gpu_type,
                    exit=job.exit,
                    last_start=job.run_start if job.first_start is not None else None,
                    node_seconds=node_s,
                    gpu_seconds=gpu_s,
                    groups_spanned=job.groups_spanned,
                    conformance_fitness=job.conformance_fitness,
                    lost_node_seconds=job.lost_node_seconds,
                    scale_ups=job.scale_ups,
                    scale_downs=job.scale_downs,
                )
            )
        m = self.m
        config: dict[str, Any] = {
            "policy": self.policy.name,
            "cycle_interval": self.cycle_interval,
            "schedule_on_arrival": self.schedule_on_arrival,
            "backfill_depth": self.backfill_depth,
            "seed": self.seed,
            "checkpoint_success_rate": self.checkpoint_success_rate,
            "checkpoint_seconds": self.checkpoint_seconds,
            "checkpoint_broker": self.checkpoint_broker,
            "sample_interval": self.sample_interval,
            "budget_period_days": self.budget_period_days,
            "default_vcluster": self.default_vcluster,
            "max_time": self.max_time,
            "rm_replay_version": __version__,
            "vclusters": {
                name: {
                    "scheduler_type": v.scheduler_type.value,
                    "backfill_depth": v.backfill_depth,
                    "allow_borrowing": v.allow_borrowing,
                    "weights": weights_as_mapping(v.weights),
                }
                for name, v in sorted(m.vclusters.items())
            },
            "tenants": {
                name: {
                    "fair_share_target": t.fair_share_target,
                    "burst_allowance": t.burst_allowance,
                    "max_nodes": t.max_nodes,
                    "max_concurrent_allocations": t.max_concurrent_allocations,
                    "gpu_hours_budget": t.gpu_hours_budget,
                    "node_hours_budget": t.node_hours_budget,
                }
                for name, t in sorted(m.tenants.items())
            },
            "rejected_assignments": self.rejected,
            "preemptions": self.preemptions,
        }
        return SimulationResult(
            policy=self.policy.name,
            seed=self.seed,
            trace_name=self.trace_name,
            inventory_summary=inventory_summary(self.inventory, m.nodes),
            jobs=records,
            samples=self.samples,
            cycles=self.cycles,
            makespan=(last_end - self.start_time) if last_end is not None else 0.0,
            fair_share_targets={n: t.fair_share_target for n, t in sorted(m.tenants.items())},
            sim_config=config,
            start_time=self.start_time,
            end_time=self.end_time,
        )


def simulate(
    trace_events: Iterable[TraceEvent],
    inventory: Inventory,
    *,
    policy: str = "lattice",
    weights_by_vcluster: Mapping[str, CostWeights] | None = None,
    cycle_interval: float = 30.0,
    schedule_on_arrival: bool = True,
    backfill_depth: int = 10,
    seed: int = 0,
    checkpoint_success_rate: float = 0.98,
    sample_interval: float = 300.0,
    checkpoint_seconds: float = 60.0,
    default_vcluster: str | None = None,
    max_time: float | None = None,
    trace_name: str = "",
    preemption_policy: PreemptionPolicy | None = None,
    skip_unchanged_cycles: bool = True,
    budget_period_days: float = DEFAULT_BUDGET_PERIOD_DAYS,
    checkpoint_broker: bool = True,
) -> SimulationResult:
    """Replay ``trace_events`` on ``inventory`` with ``policy`` (``lattice``, ``fcfs`` or
    ``easy``); see the module docstring.

    ``weights_by_vcluster``: from :func:`rm_replay.weights.load_weights`; vClusters it
    does not name use ``"*"``, else their named profile, else the baseline.
    ``default_vcluster``: the vCluster of submissions without one (default: the only
    vCluster the weights name, else ``"default"``). ``max_time``: stop at this
    simulated time (allocations still queued or running are ``unfinished``).
    ``skip_unchanged_cycles``: skip the decisions that provably cannot change
    anything (no pending allocation fits the free nodes; :meth:`Replay._unchanged`);
    False runs the policy in every cycle (same result, slower; for checking that
    claim). ``budget_period_days``: the budget ledger's window for the budget penalty
    (the live scheduler's ``scheduling.budget_period_days``, default 90).
    ``checkpoint_broker`` False: preemption stops every victim without a checkpoint
    (the counterfactual that shows what checkpoint-aware preemption saves)."""
    return Replay(
        trace_events,
        inventory,
        policy=policy,
        weights_by_vcluster=weights_by_vcluster,
        cycle_interval=cycle_interval,
        schedule_on_arrival=schedule_on_arrival,
        backfill_depth=backfill_depth,
        seed=seed,
        checkpoint_success_rate=checkpoint_success_rate,
        checkpoint_seconds=checkpoint_seconds,
        sample_interval=sample_interval,
        default_vcluster=default_vcluster,
        max_time=max_time,
        trace_name=trace_name,
        preemption_policy=preemption_policy,
        skip_unchanged_cycles=skip_unchanged_cycles,
        budget_period_days=budget_period_days,
        checkpoint_broker=checkpoint_broker,
    ).run()
