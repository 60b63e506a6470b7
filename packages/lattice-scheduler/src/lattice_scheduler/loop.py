"""The vCluster scheduling loop: watch state, decide, propose.

Stateless by design: everything it knows comes from the quorum's watch-state stream
(snapshot, then deltas) into a StateMirror, so a restart loses nothing. A cycle runs
every ``cycle_interval`` and at once when a new Pending allocation of one of its
vClusters shows up in the stream (that is how a submission "pokes" the scheduler).
Assignments carry the revision they were decided on; the quorum rejects stale or
conflicting ones and the allocation is simply tried again next cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from lattice_common import commands as c
from lattice_common.errors import LatticeError
from lattice_common.rpc import RemoteQuorum
from lattice_common.types import Allocation, AllocationState, CostWeights, SchedulerType
from lattice_common.watch import StateMirror
from prometheus_client import Counter, Gauge, Histogram

from lattice_scheduler import cost, decide
from lattice_scheduler.placement import eligible, limit_task_groups, order_pending, plan_cycle
from lattice_scheduler.preemption import PreemptionPolicy, select_victims
from lattice_scheduler.solver import Pending, Proposal, solve
from lattice_scheduler.topology import TopologyModel
from lattice_scheduler.trace_capture import TraceCapture

log = logging.getLogger("lattice.scheduler")

CYCLE = Histogram(
    "lattice_scheduling_cycle_duration_seconds",
    "Time to complete one scheduling cycle",
    ["vcluster"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
QUEUE_DEPTH = Gauge("lattice_scheduling_queue_depth", "Number of pending allocations", ["vcluster"])
PROPOSALS = Counter(
    "lattice_scheduling_proposals_total", "Proposals sent to quorum", ["vcluster", "result"]
)
COST_DURATION = Histogram(
    "lattice_scheduling_cost_function_duration_seconds",
    "Time to build the scoring context for all candidates",
    ["vcluster"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
PLACEMENTS = Counter(
    "lattice_scheduling_placements_total", "Allocations placed (assignment committed)", ["vcluster"]
)
BACKFILLED = Counter(
    "lattice_scheduling_backfill_jobs_total", "Allocations placed via backfill", ["vcluster"]
)
BORROWED = Counter(
    "lattice_scheduling_borrowed_placements_total",
    "Allocations placed on idle nodes borrowed from another vCluster's pool",
    ["vcluster"],
)
PREEMPTIONS = Counter(
    "lattice_preemptions_total",
    "Allocations preempted for higher-class work",
    ["vcluster", "reason"],
)
PREEMPTION_CANDIDATES_PER_CYCLE = 3  # blocked allocations considered for preemption per cycle


class Scheduler:
    def __init__(
        self,
        quorum: RemoteQuorum,
        vclusters: list[str],
        *,
        cycle_interval: float = 5.0,
        reconnect_delay: float = 0.5,
        trace: TraceCapture | None = None,
    ) -> None:
        self.quorum = quorum
        self.vclusters = list(vclusters)
        self.cycle_interval = cycle_interval
        self.reconnect_delay = reconnect_delay
        self.trace = trace
        self.mirror = StateMirror()
        self.preemption_policy = PreemptionPolicy()
        self.synced = asyncio.Event()
        self._poke = asyncio.Event()
        # allocation id -> revision at which our assignment committed; skipped until the
        # mirror has caught up to it (no double proposals from a stale view)
        self._inflight: dict[str, int] = {}

    def poke(self) -> None:
        self._poke.set()

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch(), name="watch-state")
        try:
            await self.synced.wait()
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._poke.wait(), self.cycle_interval)
                self._poke.clear()
                await self.cycle()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            self.quorum.endpoints.close()

    async def _watch(self) -> None:
        while True:
            try:
                async for delta in self.quorum.watch():
                    self.mirror.apply(delta)
                    if self.trace is not None:
                        self.trace.observe(delta)
                    if delta.snapshot:
                        self.synced.set()
                        self.poke()
                    elif any(n.schedulable for n in delta.nodes) or (
                        any(
                            a.state == AllocationState.PENDING and a.spec.vcluster in self.vclusters
                            for a in delta.allocations
                        )
                        and self._capacity_free()
                    ):
                        # freed capacity, or new work while something is free; new work
                        # on a full cluster waits for capacity or the periodic cycle
                        self.poke()
            except LatticeError as e:
                log.warning("watch-state stream lost (%s); reconnecting", e.message)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watch-state stream failed; reconnecting")
            await asyncio.sleep(self.reconnect_delay)

    async def cycle(self) -> None:
        rev = self.mirror.revision
        self._inflight = {k: v for k, v in self._inflight.items() if v > rev}
        m = self.mirror
        now = time.time()
        topology = TopologyModel.from_nodes(m.nodes) if m.pending else None
        holding = [m.allocations[i] for i in m.holding]
        # a preempted allocation waits until the one it made room for has started
        held_back = {
            i
            for i in m.pending
            if (p := m.allocations[i].preempted_by)
            and p in m.allocations
            and m.allocations[p].state == AllocationState.PENDING
        }
        for vc in self.vclusters:
            t0 = time.perf_counter()
            pending = [
                m.allocations[i]
                for i in m.pending
                if m.allocations[i].spec.vcluster == vc
                and i not in self._inflight
                and i not in held_back
            ]
            QUEUE_DEPTH.labels(vc).set(len(pending))
            if not pending:
                CYCLE.labels(vc).observe(time.perf_counter() - t0)
                continue
            pending, limited = limit_task_groups(pending, holding)
            v = m.vclusters.get(vc)
            if not any(n.schedulable for n in m.nodes.values()):
                # no free node anywhere: nothing can start, borrowed or not; keep the
                # cycle cheap (reasons and preemption only)
                _, waiting = plan_cycle(
                    vcluster=vc,
                    allocations=m.allocations,
                    nodes=m.nodes,
                    tenants=m.tenants,
                    pending_ids=[a.id for a in pending],
                    holding_ids=m.holding,
                )
                await self._preempt_for(vc, [*waiting, *limited], [])
                await self._publish_reasons([*waiting, *limited])
                CYCLE.labels(vc).observe(time.perf_counter() - t0)
                continue
            fifo = v is not None and v.scheduler_type == SchedulerType.INTERACTIVE_FIFO
            result = solve(
                pending,
                m.nodes,
                holding,
                score=self._scorer(vc, now),
                now=now,
                backfill_depth=0 if fifo else (v.backfill_depth if v is not None else 10),
                vcluster=vc,
                tenants=m.tenants,
                topology=topology,
            )
            proposals, waiting = result.proposals, [*result.pending, *limited]
            proposals, waiting = self._shrink_ranges(vc, pending, proposals, waiting, now)
            if v is None or v.allow_borrowing:
                borrowed, waiting = self._borrow(vc, pending, waiting, proposals, now)
                proposals = [*proposals, *borrowed]
            BACKFILLED.labels(vc).inc(sum(1 for p in proposals if p.backfilled))
            if proposals:
                batch = c.Batch(
                    commands=[
                        c.AssignNodes(
                            allocation_id=p.allocation_id,
                            node_ids=list(p.node_ids),
                            expected_revision=rev,
                            vcluster=vc,
                            now=time.time(),
                        )
                        for p in proposals
                    ],
                    now=time.time(),
                )
                try:
                    res = await self.quorum.propose(batch)
                except LatticeError as e:
                    PROPOSALS.labels(vc, "error").inc(len(proposals))
                    log.warning("proposals for %s failed: %s", vc, e.message)
                    self.poke_later()
                else:
                    for p, r in zip(proposals, res.results or [], strict=False):
                        if r.error is None:
                            PROPOSALS.labels(vc, "accepted").inc()
                            PLACEMENTS.labels(vc).inc()
                            self._inflight[p.allocation_id] = r.revision
                        else:
                            PROPOSALS.labels(vc, "rejected").inc()
                            log.info(
                                "assignment of %s rejected: %s (retrying next cycle)",
                                p.allocation_id,
                                r.error.get("message"),
                            )
            await self._preempt_for(vc, waiting, proposals)
            await self._publish_reasons(waiting)
            CYCLE.labels(vc).observe(time.perf_counter() - t0)

    def poke_later(self, delay: float = 0.5) -> None:
        asyncio.get_running_loop().call_later(delay, self.poke)

    async def _preempt_for(
        self, vc: str, waiting: list[Pending], proposals: list[Proposal]
    ) -> None:
        """Start preempting lower-class work for the highest blocked allocations."""
        m = self.mirror
        occupied = [w.allocation_id for w in waiting if w.reason == "all suitable nodes occupied"]
        if not occupied:
            return
        now = time.time()
        taken = {n for p in proposals for n in p.node_ids}
        free = [n for n in m.nodes.values() if eligible(n, vc) and n.id not in taken]
        running = [
            m.allocations[i] for i in m.holding if m.allocations[i].state == AllocationState.RUNNING
        ]
        releasing_for = {
            m.allocations[i].preempted_by
            for i in m.holding
            if m.allocations[i].state == AllocationState.CHECKPOINTING
        }
        # borrowers on this vCluster's home pool: reclaimable whatever their class
        reclaimable = frozenset(
            a.id
            for a in running
            if a.spec.vcluster != vc
            and any(n in m.nodes and m.nodes[n].home_vcluster == vc for n in a.assigned_nodes)
        )
        jobs = order_pending(m.allocations[i] for i in occupied)
        chosen: set[str] = set()
        cmds: list[c.Command] = []
        for job in jobs[:PREEMPTION_CANDIDATES_PER_CYCLE]:
            if job.id in releasing_for or (job.spec.preemption_class == 0 and not reclaimable):
                continue  # its victims are already on their way out / nothing is below it
            victims = select_victims(
                job,
                [a for a in running if a.id not in chosen],
                m.nodes,
                now=now,
                free_nodes=free,
                policy=self.preemption_policy,
                reclaimable=reclaimable,
            )
            if not victims:
                continue
            chosen.update(victims)
            cmds.extend(
                c.PreemptAllocation(
                    allocation_id=v, preemptor_id=job.id, reason="preempted", now=now
                )
                for v in victims
            )
        if not cmds:
            return
        try:
            res = await self.quorum.propose(c.Batch(commands=cmds, now=now))
        except LatticeError as e:
            log.warning("preemption proposals for %s failed: %s", vc, e.message)
            return
        for cmd, r in zip(cmds, res.results or [], strict=False):
            if r.error is None:
                why = "reclaim" if cmd.allocation_id in reclaimable else "higher_priority"  # type: ignore[attr-defined]
                PREEMPTIONS.labels(vc, why).inc()
                log.info("preempting %s for %s", cmd.allocation_id, cmd.preemptor_id)  # type: ignore[attr-defined]

    async def _publish_reasons(self, waiting: list[Pending]) -> None:
        """Tell users why their allocations wait; only changed reasons go to the quorum."""
        allocs = self.mirror.allocations
        changed = {
            w.allocation_id: w.reason
            for w in waiting
            if w.allocation_id in allocs and allocs[w.allocation_id].pending_reason != w.reason
        }
        if not changed:
            return
        try:
            await self.quorum.propose(c.SetPendingReasons(reasons=changed, now=time.time()))
        except LatticeError as e:
            log.info("could not publish pending reasons: %s", e.message)

    def _scorer(self, vc: str, now: float) -> Callable[[Allocation], float]:
        """This cycle's ordering for a vCluster: Score(j) = sum w_i f_i(j) with the
        vCluster's current weights (re-read every cycle, so set-weights needs no
        restart), or arrival order for interactive-fifo."""
        v = self.mirror.vclusters.get(vc)
        if v is not None and v.scheduler_type == SchedulerType.INTERACTIVE_FIFO:
            return lambda a: -a.submitted_at
        t0 = time.perf_counter()
        ctx = cost.build_context(self.mirror, now, vcluster=vc)
        weights = v.weights if v is not None else CostWeights()
        COST_DURATION.labels(vc).observe(time.perf_counter() - t0)
        return lambda a: cost.score(a, ctx, weights)

    def _borrow(
        self,
        vc: str,
        pending: list[Allocation],
        waiting: list[Pending],
        proposals: list[Proposal],
        now: float,
    ) -> tuple[list[Proposal], list[Pending]]:
        borrowed, waiting = decide.borrow(
            self.mirror, vc, pending, waiting, proposals, now, self._scorer(vc, now)
        )
        if borrowed:
            BORROWED.labels(vc).inc(len(borrowed))
        return borrowed, waiting

    def _capacity_free(self) -> bool:
        return any(n.schedulable for n in self.mirror.nodes.values())

    def _shrink_ranges(
        self,
        vc: str,
        pending: list[Allocation],
        proposals: list[Proposal],
        waiting: list[Pending],
        now: float,
    ) -> tuple[list[Proposal], list[Pending]]:
        return decide.shrink_ranges(self.mirror, vc, pending, proposals, waiting, now)
