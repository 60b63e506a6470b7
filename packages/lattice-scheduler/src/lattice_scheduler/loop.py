"""The vCluster scheduling loop: watch state, decide, propose.

Stateless by design: everything it knows comes from the quorum's watch-state stream
(snapshot, then deltas) into a StateMirror, so a restart loses nothing. A cycle runs
every ``cycle_interval`` and at once when a new Pending allocation of one of its
vClusters shows up in the stream (that is how a submission "pokes" the scheduler).
A node handed to its next allocation pokes a hand-over cycle instead: only the head
of the last full cycle's order and what became Pending since are considered
(``decide``'s shortlist), to give the node the allocation after that; a full cycle
still runs at least every ``cycle_interval`` and on every other poke, and a change of
order among the rest of the queue (aging, a changed priority) is seen by the next one.
Assignments carry the revision they were decided on; the quorum rejects stale or
conflicting ones and the allocation is simply tried again next cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from lattice_common import commands as c
from lattice_common import ledger
from lattice_common.errors import LatticeError
from lattice_common.rpc import RemoteQuorum
from lattice_common.types import (
    ESTIMATE_NOW,
    Allocation,
    AllocationState,
    Node,
    SchedulerType,
    StartEstimate,
)
from lattice_common.watch import StateMirror
from prometheus_client import Counter, Gauge, Histogram

from lattice_scheduler import cost, decide, estimate
from lattice_scheduler.autoscaler import Autoscaler
from lattice_scheduler.handoff import next_allocations
from lattice_scheduler.preemption import PreemptionPolicy
from lattice_scheduler.solver import Pending, Proposal
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
HANDOVER_CYCLE = Histogram(
    "lattice_scheduling_handover_cycle_duration_seconds",
    "Time to complete one hand-over cycle (the head of the queue only)",
    ["vcluster"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
COST_DURATION = Histogram(
    "lattice_scheduling_cost_function_duration_seconds",
    "Time to build the scoring context for all candidates",
    ["vcluster"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
NEXT_QUEUED = Counter(
    "lattice_scheduling_next_allocations_total",
    "Busy nodes given a next allocation (handed over when their owner ends)",
    ["vcluster"],
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


VICTIM_REQUEUES = Counter(
    "lattice_preemption_victim_requeue_total",
    "Preempted allocations re-entering the queue",
    ["vcluster"],
)
CHECKPOINT_DURATION = Histogram(
    "lattice_preemption_checkpoint_duration_seconds",
    "Time from a victim's checkpoint hint until it released its nodes",
    ["vcluster"],
    buckets=(0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1200),
)

ESTIMATE_DURATION = Histogram(
    "lattice_scheduling_estimate_duration_seconds",
    "Time to simulate a vCluster's queue forward for start estimates (between cycles)",
    ["vcluster"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30),
)

ESTIMATE_GAP = 2.0  # seconds between two simulations, at least
ESTIMATE_OVERDUE = 30.0  # seconds after which a simulation no longer waits for quiet

AUTOSCALE_TICK = 1.0  # seconds between looks at the reactive allocations

ESTIMATE_FAILURES = Counter(
    "lattice_scheduling_estimate_failures_total",
    "Forward simulations for start estimates that failed (no estimates published)",
)


class Scheduler:
    def __init__(
        self,
        quorum: RemoteQuorum,
        vclusters: list[str],
        *,
        cycle_interval: float = 5.0,
        reconnect_delay: float = 0.5,
        trace: TraceCapture | None = None,
        budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
        estimates: bool = True,
        estimate_budget_seconds: float = 1.0,
        autoscaler: Autoscaler | None = None,
    ) -> None:
        self.quorum = quorum
        self.vclusters = list(vclusters)
        self.cycle_interval = cycle_interval
        self.reconnect_delay = reconnect_delay
        self.trace = trace
        # the budget penalty's window: the API reports usage over the same one
        self.budget_period_days = budget_period_days
        self.mirror = StateMirror()
        self.preemption_policy = PreemptionPolicy()
        self.synced = asyncio.Event()
        self._poke = asyncio.Event()
        self._reserve_busy = False  # the next cycle reserves even when no node is free
        # hand-over cycles: the last full cycle's order per vCluster and how far into
        # it that cycle reserved; what became Pending since; whether a full cycle is due
        self._ranked: dict[str, list[str]] = {}
        self._reach: dict[str, int] = {}
        self._context: dict[str, cost.ScoringContext] = {}
        self._arrived: set[str] = set()
        self._full_due = True
        self._last_full = -math.inf
        # allocation id -> revision at which our assignment committed; skipped until the
        # mirror has caught up to it (no double proposals from a stale view)
        self._inflight: dict[str, int] = {}
        # start estimates beyond the cycle's own: simulated between cycles, dropped when
        # the next cycle is due (an estimate never delays a decision)
        self.estimates = estimates
        self._simulations: list[tuple[str, float, decide.CycleDecision]] = []
        # CPU the simulations may take per cycle interval (the rest stays idle)
        self.estimate_budget = min(estimate_budget_seconds, 0.2 * cycle_interval)
        # simulate only once the loop has been quiet this long (a busy scheduler spends
        # its time deciding), at most once per ESTIMATE_GAP, and regardless of quiet
        # once ESTIMATE_OVERDUE has passed without one
        self.estimate_quiet = min(1.0, 0.5 * cycle_interval)
        self._last_estimate = -math.inf
        self._estimating: asyncio.Task[None] | None = None
        # reactive allocations: evaluated on their own tick, beside the cycles
        self.autoscaler = autoscaler

    def poke(self, *, handover: bool = False) -> None:
        """Run a cycle now: a full one unless every poke since the last was a hand-over."""
        if not handover:
            self._full_due = True
        self._poke.set()

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch(), name="watch-state")
        scaler = (
            asyncio.create_task(self._autoscale(), name="autoscale")
            if self.autoscaler is not None
            else None
        )
        try:
            await self.synced.wait()
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._poke.wait(), self.cycle_interval)
                self._poke.clear()
                await self._stop_estimating()
                full = self._full_due or time.monotonic() - self._last_full >= self.cycle_interval
                self._full_due = False
                await self.cycle(full=full)
                if self._simulations:
                    self._estimating = asyncio.create_task(self._estimate(), name="estimates")
        finally:
            await self._stop_estimating()
            for task in (watcher, scaler):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            self.quorum.endpoints.close()

    async def _autoscale(self, tick: float = AUTOSCALE_TICK) -> None:
        """Reactive allocations (``autoscaler.Autoscaler``), looked at every ``tick``;
        a failure costs that round, never the scheduler."""
        assert self.autoscaler is not None
        await self.synced.wait()
        while True:
            try:
                await self.autoscaler.evaluate(self.mirror)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaling round failed (retrying)")
            await asyncio.sleep(tick)

    async def _watch(self) -> None:
        while True:
            try:
                async for delta in self.quorum.watch():
                    handed = not delta.snapshot and self._handed_over(delta.nodes)
                    if not delta.snapshot:
                        self._observe_preemptions(delta.allocations)
                        self._note_arrivals(delta.allocations)
                    self.mirror.apply(delta)
                    if self.trace is not None:
                        self.trace.observe(delta)
                    if delta.snapshot:
                        self.synced.set()
                        self.poke()
                    elif handed:
                        # a node went to its next allocation: queue the one after it
                        self._reserve_busy = True
                        self.poke(handover=True)
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

    def _note_arrivals(self, changed: list[Allocation]) -> None:
        """Allocations that became eligible Pending (submitted, requeued, released from a
        hold) since the last full cycle: every hand-over cycle considers them."""
        allocs = self.mirror.allocations
        for a in changed:
            if a.state != AllocationState.PENDING or a.held:
                continue
            prev = allocs.get(a.id)
            if prev is None or prev.state != AllocationState.PENDING or prev.held:
                self._arrived.add(a.id)

    def _shortlist(self, vc: str) -> set[str] | None:
        """What a hand-over cycle of ``vc`` considers: the first still-Pending ones of the
        last full cycle's order, as many as it reached with its reservations plus the
        backfill depth, and the arrivals since. None: a full cycle is needed (no order
        yet, a free node, a sensitive vCluster)."""
        ranked = self._ranked.get(vc)
        m = self.mirror
        if (
            ranked is None
            or self._capacity_free()
            or decide.scheduler_type(m, vc) == SchedulerType.SENSITIVE_RESERVATION
        ):
            return None
        want = self._reach.get(vc, 0) + decide.backfill_depth(m, vc)
        pending = m.pending
        head: set[str] = set()
        for i in ranked:
            if len(head) >= want:
                break
            if i in pending:
                head.add(i)
        return head | {i for i in self._arrived if i in pending}

    def _rank(self, vc: str, d: decide.CycleDecision) -> None:
        """Keep a full cycle's order for the hand-over cycles until the next full one."""
        if not d.order or d.context is None:
            self._ranked.pop(vc, None)
            return
        self._context[vc] = d.context
        reserved = {r.allocation_id for r in d.reservations}
        self._ranked[vc] = d.order
        self._reach[vc] = max((i + 1 for i, a in enumerate(d.order) if a in reserved), default=0)

    def _handed_over(self, nodes: list[Node]) -> bool:
        """A node of this scheduler's vClusters lost its next allocation (a hand-over,
        or the entry dropped as stale)."""
        for n in nodes:
            prev = self.mirror.nodes.get(n.id)
            if (
                prev is not None
                and prev.next_allocation
                and not n.next_allocation
                and prev.owner_vcluster in self.vclusters
            ):
                return True
        return False

    async def cycle(self, *, full: bool = True) -> None:
        """One cycle over every vCluster; ``full`` False: a hand-over cycle where one can
        be (``_shortlist``)."""
        rev = self.mirror.revision
        reserve_busy, self._reserve_busy = self._reserve_busy, False
        if full:
            self._last_full = time.monotonic()
            self._arrived = set()
        self._inflight = {k: v for k, v in self._inflight.items() if v > rev}
        m = self.mirror
        now = time.time()
        topology = TopologyModel.from_nodes(m.nodes) if m.pending else None
        inflight = set(self._inflight)
        exclude: set[str] | None = None  # + the held-back ones: a scan of the queue
        self._simulations = []
        for vc in self.vclusters:
            t0 = time.perf_counter()
            shortlist = None if full else self._shortlist(vc)
            if shortlist is None and exclude is None:
                exclude = decide.held_back_ids(m) | inflight
            d = decide.decide_vcluster(
                m,
                vc,
                now,
                topology=topology,
                preemption_policy=self.preemption_policy,
                # (a hand-over cycle leaves the held-back ones out itself)
                exclude=inflight if shortlist is not None else exclude,
                budget_period_days=self.budget_period_days,
                reserve_busy=reserve_busy,
                shortlist=shortlist,
                context=self._context.get(vc),
            )
            if d.shortlisted:
                await self._hand_over_cycle(vc, d, rev)
                HANDOVER_CYCLE.labels(vc).observe(time.perf_counter() - t0)
                continue
            self._rank(vc, d)
            QUEUE_DEPTH.labels(vc).set(len(d.queue))
            if d.queue and not d.nothing_free:
                COST_DURATION.labels(vc).observe(d.cost_seconds)
            if d.borrowed:
                BORROWED.labels(vc).inc(len(d.borrowed))
            proposals = [*d.proposals, *d.borrowed]
            BACKFILLED.labels(vc).inc(sum(1 for p in proposals if p.backfilled))
            if proposals:
                await self._assign(vc, proposals, rev)
            if not d.nothing_free:  # reservations made: busy nodes' next allocations
                await self._queue_next(vc, d, proposals)
            await self._preempt(vc, d.preemptions)
            await self._publish_reasons(d.waiting)
            CYCLE.labels(vc).observe(time.perf_counter() - t0)
            if self.estimates and d.queue:
                self._simulations.append((vc, now, d))

    async def _hand_over_cycle(self, vc: str, d: decide.CycleDecision, rev: int) -> None:
        if d.proposals:
            await self._assign(vc, d.proposals, rev)
        await self._queue_next(vc, d, d.proposals)

    async def _assign(self, vc: str, proposals: list[Proposal], rev: int) -> None:
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
            return
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

    async def _queue_next(
        self, vc: str, d: decide.CycleDecision, proposals: list[Proposal]
    ) -> None:
        changes = next_allocations(
            self.mirror, vc, d.reservations, {p.allocation_id for p in proposals}
        )
        if not changes:
            return
        try:
            res = await self.quorum.propose(
                c.SetNextAllocations(next=changes, vcluster=vc, now=time.time())
            )
        except LatticeError as e:
            log.warning("next allocations for %s failed: %s", vc, e.message)
            return
        if res.error:  # e.g. one of them was assigned meanwhile: the next cycle redoes it
            log.info("next allocations for %s refused: %s", vc, res.error.get("message"))
        else:
            NEXT_QUEUED.labels(vc).inc(sum(1 for aid in changes.values() if aid))

    def poke_later(self, delay: float = 0.5) -> None:
        asyncio.get_running_loop().call_later(delay, self.poke)

    async def _preempt(self, vc: str, preemptions: list[decide.Preemption]) -> None:
        """Start preempting: each victim goes to Checkpointing with a hint recorded."""
        if not preemptions:
            return
        now = time.time()
        cmds: list[c.Command] = [
            c.PreemptAllocation(
                allocation_id=p.victim, preemptor_id=p.preemptor, reason="preempted", now=now
            )
            for p in preemptions
        ]
        try:
            res = await self.quorum.propose(c.Batch(commands=cmds, now=now))
        except LatticeError as e:
            log.warning("preemption proposals for %s failed: %s", vc, e.message)
            return
        for p, r in zip(preemptions, res.results or [], strict=False):
            if r.error is None:
                PREEMPTIONS.labels(vc, p.reason).inc()
                log.info("preempting %s for %s (%s)", p.victim, p.preemptor, p.reason)

    async def _publish_reasons(
        self, waiting: list[Pending], estimates: dict[str, StartEstimate] | None = None
    ) -> None:
        """Tell users why their allocations wait and when they should start; only what
        changed goes to the quorum."""
        allocs = self.mirror.allocations
        reasons = {
            w.allocation_id: text
            for w in waiting
            if w.allocation_id in allocs
            and allocs[w.allocation_id].pending_reason != (text := w.text)
        }
        starts = estimate.changed(estimates or {}, allocs)
        if not reasons and not starts:
            return
        try:
            await self.quorum.propose(
                c.SetPendingReasons(reasons=reasons, estimates=starts, now=time.time())
            )
        except LatticeError as e:
            log.info("could not publish pending reasons: %s", e.message)

    async def _estimate(self) -> None:
        """:meth:`_simulate` once the loop has been quiet (see ``estimate_quiet``); its
        failure costs the estimates, never the scheduler: logged and counted. A new
        cycle cancels it, the quiet wait included."""
        since = time.monotonic() - self._last_estimate
        wait = 0.0 if since > ESTIMATE_OVERDUE else self.estimate_quiet
        wait = max(wait, ESTIMATE_GAP - since)
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_estimate = time.monotonic()
        try:
            await self._simulate()
        except asyncio.CancelledError:
            raise
        except Exception:
            ESTIMATE_FAILURES.inc()
            log.exception("start estimates failed (scheduling goes on without them)")

    async def _simulate(self) -> None:
        """Between cycles: simulate each vCluster's queue forward from the cycle's
        decision, one decision at a time, yielding to the event loop after each so that
        a poke starts the next cycle (which drops this work) without waiting for it,
        within ``estimate_budget`` seconds in all; then publish what it found.
        Allocations that a finished simulation could not place within its horizon lose
        their estimate."""
        deadline = time.perf_counter() + self.estimate_budget
        for vc, now, d in self._simulations:
            t0 = time.perf_counter()
            sim = estimate.Simulation(
                self.mirror, vc, now, d, budget_period_days=self.budget_period_days
            )
            while not sim.done and time.perf_counter() < deadline:
                await asyncio.sleep(0)
                if self._poke.is_set():
                    return
                sim.step()
            ESTIMATE_DURATION.labels(vc).observe(time.perf_counter() - t0)
            found = {a: e for a, e in sim.estimates.items() if e.estimate_basis != ESTIMATE_NOW}
            cleared = {aid: StartEstimate() for aid in sim.unreachable()}
            await self._publish_reasons([], {**found, **cleared})
            if time.perf_counter() >= deadline:
                return

    async def _stop_estimating(self) -> None:
        task, self._estimating = self._estimating, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _observe_preemptions(self, changed: list[Allocation]) -> None:
        """Victims of this scheduler's vClusters coming back: requeued after their
        checkpoint hint (duration from hint to release), or ended instead."""
        for a in changed:
            before = self.mirror.allocations.get(a.id)
            if (
                before is None
                or before.state != AllocationState.CHECKPOINTING
                or a.state == AllocationState.CHECKPOINTING
                or a.spec.vcluster not in self.vclusters
            ):
                continue
            if a.state == AllocationState.PENDING:
                VICTIM_REQUEUES.labels(a.spec.vcluster).inc()
            if before.checkpoint_hint_at is not None:
                ended = a.finished_at or time.time()
                CHECKPOINT_DURATION.labels(a.spec.vcluster).observe(
                    max(0.0, ended - before.checkpoint_hint_at)
                )

    def _capacity_free(self) -> bool:
        return any(n.schedulable for n in self.mirror.nodes.values())
