"""The autoscaler's shell: reactive allocations of this scheduler's vClusters, their
metric from the TSDB every evaluation interval, :func:`autoscale.decide`, and the
decision proposed to the quorum.

* metric: one instant query per allocation and evaluation (``autoscale.metric_query``)
  against ``telemetry.tsdb_endpoint``; its per-node values become one :class:`Sample`
  (``autoscale.utilization``). A failed query is a sample without value (no action),
  counted in ``lattice_autoscaling_metric_query_failures_total`` and logged, at warning
  from the third failure in a row (the alert rule fires on the counter). No endpoint
  configured: every evaluation is "no metric". The node agents' heartbeats carry no
  per-allocation utilisation, so the TSDB is the only source.
* up: ``ScaleAllocation`` adding one node, chosen by the solver (a one-node trial of the
  allocation: the hard filter, pools, topology), preferring the dragonfly groups the
  allocation already uses. Down: removing its most recently added node (never the first,
  where its entrypoint runs). The decision and its reason travel in the same command
  (``ScalingStatus``); a rejected proposal counts towards the backoff and is retried at
  the next evaluation.
* down, checkpointable allocation (spec: Reactive Allocation Checkpointing): first the
  nodes to release go into ``ScalingStatus.releasing`` with a checkpoint hint (the
  broker's checkpoint-and-continue, run by the head node's agent through the
  application's protocol), in one Batch; the ``ScaleAllocation`` that removes them
  follows, on the scheduler's next tick, once the hint's outcome is in or after
  ``release_timeout`` (``checkpoint.checkpoint_timeout_seconds``), whichever comes first
  (:func:`autoscale.release_step`). No metric evaluation meanwhile.
* borrowed nodes: a scale-up with no free node in the allocation's own (or the shared)
  pool borrows an idle node of a vCluster that lends (only ever beyond ``min_nodes``,
  which the start placed). When that node's home vCluster has work waiting, the node
  is given back through the same two steps with the borrowed-node grace
  (``node_agent.borrowed_grace_period_seconds``, 30 s) as the deadline, and the
  scheduler's preemption leaves the allocation alone meanwhile
  (``autoscale.gives_back_by_scaling``).
* oscillation: scale events that alternate for more than 5 cycles set
  ``lattice_autoscaling_oscillating_allocations`` (the alert rule fires on it) and log
  a warning suggesting a wider target band or a longer cooldown.
* hold: when what blocks the allocation changes (quota, no free node, no metric,
  backoff, at max_nodes, or nothing any more), ``SetScalingStatus``.

The sample history lives in memory: a restarted scheduler starts the windows afresh
(it waits one window longer, never scales early). Cooldown and the last scale event
come from the quorum (``Allocation.scaling_status``), so they survive restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from lattice_common import commands as c
from lattice_common import promql
from lattice_common.errors import LatticeError
from lattice_common.rpc import RemoteQuorum
from lattice_common.types import (
    HOLDING_STATES,
    SCALE_DOWN,
    SCALE_HOLD,
    SCALE_UP,
    Allocation,
    AllocationState,
    LifecycleType,
    ScalingSpec,
    ScalingStatus,
    SchedulerType,
)
from lattice_common.watch import StateMirror
from prometheus_client import Counter, Gauge

from lattice_scheduler import autoscale
from lattice_scheduler.solver import solve

log = logging.getLogger("lattice.scheduler.autoscaler")

DECISIONS = Counter(
    "lattice_autoscaling_decisions_total",
    "Autoscaling evaluations of reactive allocations, by decision (up, down, hold)",
    ["decision"],
)
QUERY_FAILURES = Counter(
    "lattice_autoscaling_metric_query_failures_total",
    "Scaling metric queries that failed (TSDB down, refused or unreadable); no action",
)
PROPOSALS = Counter(
    "lattice_autoscaling_proposals_total",
    "Scale proposals sent to the quorum, by result (accepted, rejected, error)",
    ["result"],
)

OSCILLATING = Gauge(
    "lattice_autoscaling_oscillating_allocations",
    "Reactive allocations whose scale events alternated up/down for more than 5 cycles",
)
RELEASES = Counter(
    "lattice_autoscaling_releases_total",
    "Scale-downs that waited (for a checkpoint, or a reclaimed borrowed node's grace), by "
    "how the nodes went (checkpointed; failed: the application could not checkpoint; "
    "timeout: no outcome in time)",
    ["result"],
)

#: seconds one TSDB query may take
QUERY_TIMEOUT = 10.0
#: failures in a row after which each further one is logged as a warning
ALERT_AFTER = 3


class MetricUnavailable(Exception):
    """The TSDB could not answer (no endpoint, down, refused, unreadable)."""


def query_tsdb(url: str, expr: str, scope: Mapping[str, str], timeout: float) -> list[Any]:
    """An instant query's result vector (blocking: run it in a thread). ``scope`` goes as
    VictoriaMetrics ``extra_label`` parameters; ``nocache=1`` as the API's client."""
    if not url:
        raise MetricUnavailable("no TSDB configured (telemetry.tsdb_endpoint)")
    base = url if "://" in url else "http://" + url
    params = [("query", expr), *promql.scope_params(scope), ("nocache", "1")]
    full = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(full, timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise MetricUnavailable(f"the TSDB answered {e.code}") from None
    except (OSError, ValueError) as e:
        raise MetricUnavailable(f"the TSDB cannot be reached ({type(e).__name__})") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        raise MetricUnavailable("the TSDB sent an answer that is not a query result")
    result = (body.get("data") or {}).get("result")
    return result if isinstance(result, list) else []


def per_node_values(result: list[Any]) -> dict[str, float]:
    """node_id -> value of an ``avg by (node_id)`` vector (NaN and junk dropped)."""
    out: dict[str, float] = {}
    for item in result:
        try:
            node = str(item["metric"].get("node_id", ""))
            value = float(item["value"][1])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            continue
        if value == value:  # not NaN
            out[node] = value
    return out


@dataclass
class _Track:
    """What the shell remembers of one reactive allocation between evaluations."""

    samples: deque[autoscale.Sample] = field(default_factory=lambda: deque(maxlen=512))
    next_at: float = 0.0
    rejections: int = 0
    last_rejection_at: float | None = None
    started_at: float | None = None
    events: deque[str] = field(default_factory=lambda: deque(maxlen=16))  # up/down, in order


Query = Callable[[str, str, Mapping[str, str], float], list[Any]]


class Autoscaler:
    """``await autoscaler.evaluate(mirror)`` once per tick (the scheduler's loop calls it
    about every second); each reactive allocation is evaluated when its own
    ``evaluation_interval`` has passed."""

    def __init__(
        self,
        quorum: RemoteQuorum,
        vclusters: list[str],
        *,
        tsdb_url: str = "",
        default_interval: float = 60.0,
        release_timeout: float = 600.0,
        borrowed_grace: float = 30.0,
        query: Query = query_tsdb,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.quorum = quorum
        self.vclusters = set(vclusters)
        self.tsdb_url = tsdb_url
        self.default_interval = default_interval
        self.release_timeout = release_timeout
        self.borrowed_grace = borrowed_grace
        self.query = query
        self.clock = clock
        self.tracks: dict[str, _Track] = {}
        self.failures_in_a_row = 0

    def reactive(self, m: StateMirror) -> list[Allocation]:
        return [
            a
            for aid in m.holding
            if (a := m.allocations[aid]).state == AllocationState.RUNNING
            and a.spec.lifecycle == LifecycleType.REACTIVE
            and a.spec.vcluster in self.vclusters
            and a.spec.min_nodes > 0
        ]

    def spec_of(self, a: Allocation) -> ScalingSpec:
        s = a.spec.scaling or ScalingSpec(evaluation_interval=self.default_interval)
        return s

    async def evaluate(self, m: StateMirror) -> None:
        live = self.reactive(m)
        ids = {a.id for a in live}
        for gone in set(self.tracks) - ids:
            del self.tracks[gone]
        now = self.clock()
        for a in live:
            t = self.tracks.setdefault(a.id, _Track())
            if t.started_at != a.started_at:  # (re)started: windows begin afresh
                t.samples.clear()
                t.events.clear()
                t.started_at = a.started_at
                t.rejections, t.last_rejection_at = 0, None
            if a.scaling_status is not None and a.scaling_status.releasing:
                await self._release(m, a, t, now)  # every tick: the nodes go promptly
                continue
            node, home = self._reclaimed(m, a)
            if node:  # every tick: the home vCluster wants it back
                why = f"vCluster {home} reclaims borrowed node {node}"
                await self._prepare_release(a, node, why, now, by=now + self.borrowed_grace)
                continue
            if now < t.next_at:
                continue
            spec = self.spec_of(a)
            t.next_at = now + spec.evaluation_interval
            await self._evaluate_one(m, a, spec, t, now)
        OSCILLATING.set(sum(autoscale.oscillating(t.events) for t in self.tracks.values()))

    async def _evaluate_one(
        self, m: StateMirror, a: Allocation, spec: ScalingSpec, t: _Track, now: float
    ) -> None:
        value = await self._metric(m, a, spec)
        t.samples.append(autoscale.Sample(now, value))
        status = a.scaling_status or ScalingStatus()
        last_event = max(
            [x for x in (a.started_at, status.at if status.last_decision else None) if x],
            default=None,
        )
        candidate = self._node_to_add(m, a)
        state = autoscale.ScalingState(
            samples=tuple(t.samples),
            current=len(a.assigned_nodes),
            min_nodes=a.spec.min_nodes,
            max_nodes=a.spec.nodes,
            last_event_at=last_event,
            rejections=t.rejections,
            last_rejection_at=t.last_rejection_at,
            quota=self._quota(m, a),
            free_nodes=1 if candidate else 0,
        )
        d = autoscale.decide(state, spec, now)
        DECISIONS.labels(d.action).inc()
        log.debug("allocation %s: %s (%s)", a.id, d.action, d.reason)
        if d.action == SCALE_HOLD:
            await self._publish_hold(a, d)
            return
        if d.action == SCALE_UP and candidate:
            cmd = c.ScaleAllocation(allocation_id=a.id, add_node_ids=[candidate])
            target = state.current + 1
        else:
            removable = a.assigned_nodes[1:]
            if d.action != SCALE_DOWN or not removable:
                return
            if a.spec.checkpointable and a.spec.scaling is not None:
                by = now + self.release_timeout
                await self._prepare_release(a, removable[-1], d.reason, now, by=by)
                return
            cmd = c.ScaleAllocation(allocation_id=a.id, remove_node_ids=[removable[-1]])
            target = state.current - 1
        cmd = msgspec.structs.replace(
            cmd,
            expected_revision=m.revision,
            vcluster=a.spec.vcluster,
            now=now,
            status=ScalingStatus(
                target=target, last_decision=d.action, reason=d.reason, at=now, blocked=""
            ),
        )
        await self._propose_scale(a, cmd, t, now, d)

    def _reclaimed(self, m: StateMirror, a: Allocation) -> tuple[str, str]:
        """(borrowed node to give back, its home vCluster), or ("", "")."""
        if a.spec.scaling is None:
            return "", ""
        homes = {nid: n.home_vcluster for nid in a.assigned_nodes if (n := m.nodes.get(nid))}
        if not any(h and h != a.spec.vcluster for h in homes.values()):
            return "", ""
        wanted = {m.allocations[aid].spec.vcluster for aid in m.pending}
        node = autoscale.reclaimed_node(a.assigned_nodes, homes, a.spec.vcluster, wanted)
        return node, homes.get(node, "")

    async def _prepare_release(
        self, a: Allocation, node: str, reason: str, now: float, *, by: float
    ) -> None:
        """The first step of a scale-down that waits: the node to release and the
        deadline ``by`` recorded, the checkpoint hint issued when the allocation has a
        protocol (if one is outstanding already, its outcome serves). The decision
        counts from here for the cooldown."""
        status = ScalingStatus(
            target=len(a.assigned_nodes) - 1,
            last_decision=SCALE_DOWN,
            reason=reason,
            at=now,
            releasing=[node],
            release_at=now,
            release_by=by,
        )
        cmds: list[c.Command] = [c.SetScalingStatus(statuses={a.id: status}, now=now)]
        if a.spec.checkpointable and not _hint_outstanding(a):
            cmds.append(self._hint(a, node, now))
        try:
            res = await self.quorum.propose(c.Batch(commands=cmds))
        except LatticeError as e:
            log.warning("scale-down of %s not started: %s", a.id, e.message)
            return
        errors = [r.error for r in res.results or [] if r.error is not None]
        log.info(
            "allocation %s: releasing %s (in %.0f s at the latest): %s%s",
            a.id,
            node,
            by - now,
            reason,
            f" ({errors[0].get('message')})" if errors else "",
        )

    def _hint(self, a: Allocation, node: str, now: float) -> c.IssueCheckpointHint:
        return c.IssueCheckpointHint(
            allocation_id=a.id,
            epoch=a.checkpoint_hints,
            reason=f"scale_down: releasing {node}",
            now=now,
        )

    async def _release(self, m: StateMirror, a: Allocation, t: _Track, now: float) -> None:
        """The second step: release the nodes once the checkpoint is in or the time is
        up (a lost hint is issued again meanwhile)."""
        status = a.scaling_status
        assert status is not None
        ck = a.last_checkpoint
        step = autoscale.release_step(
            status.releasing,
            status.release_at,
            status.release_by,
            a.checkpoint_hint,
            _hint_outstanding(a),
            ck.id if ck is not None else "",
            now,
            checkpointable=a.spec.checkpointable,
        )
        if step is None or step.action == autoscale.RELEASE_WAIT:
            return
        if step.action == autoscale.RELEASE_HINT:
            try:
                await self.quorum.propose(self._hint(a, status.releasing[0], now))
            except LatticeError as e:
                log.info("checkpoint hint for %s not issued: %s", a.id, e.message)
            return
        gone = [n for n in status.releasing if n in a.assigned_nodes[1:]]
        done = ScalingStatus(
            target=len(a.assigned_nodes) - len(gone),
            last_decision=SCALE_DOWN,
            reason=f"{status.reason}; {step.why}"[:200],
            at=now,
        )
        if not gone:  # nothing left to release (changed meanwhile): just settle
            await self._settle(a, done)
            return
        cmd = c.ScaleAllocation(
            allocation_id=a.id,
            remove_node_ids=gone,
            expected_revision=m.revision,
            vcluster=a.spec.vcluster,
            now=now,
            status=done,
        )
        d = autoscale.Decision(SCALE_DOWN, done.reason)
        if await self._propose_scale(a, cmd, t, now, d):
            RELEASES.labels(step.result).inc()

    async def _settle(self, a: Allocation, status: ScalingStatus) -> None:
        try:
            await self.quorum.propose(c.SetScalingStatus(statuses={a.id: status}, now=status.at))
        except LatticeError as e:
            log.info("could not publish the scaling status of %s: %s", a.id, e.message)

    async def _metric(self, m: StateMirror, a: Allocation, spec: ScalingSpec) -> float | None:
        try:
            expr, scope = autoscale.metric_query(
                spec.metric, a.id, a.assigned_nodes, spec.evaluation_interval
            )
        except ValueError as e:  # refused at submit; kept safe for old records
            log.warning("allocation %s: unusable scaling metric (%s)", a.id, e)
            return None
        try:
            result = await asyncio.to_thread(self.query, self.tsdb_url, expr, scope, QUERY_TIMEOUT)
        except MetricUnavailable as e:
            QUERY_FAILURES.inc()
            self.failures_in_a_row += 1
            level = logging.WARNING if self.failures_in_a_row >= ALERT_AFTER else logging.INFO
            log.log(
                level,
                "scaling metric of %s unavailable (%s; %d in a row): no scaling decision",
                a.id,
                e,
                self.failures_in_a_row,
            )
            return None
        self.failures_in_a_row = 0
        cores = {
            nid: n.capabilities.cpu_cores for nid in a.assigned_nodes if (n := m.nodes.get(nid))
        }
        return autoscale.utilization(spec.metric, per_node_values(result), cores)

    def _quota(self, m: StateMirror, a: Allocation) -> tuple[str, int, int] | None:
        t = m.tenants.get(a.spec.tenant)
        if t is None or t.max_nodes is None:
            return None
        held = sum(
            len(x.assigned_nodes)
            for aid in m.holding
            if (x := m.allocations[aid]).spec.tenant == t.name and x.state in HOLDING_STATES
        )
        return t.name, held, t.max_nodes

    def _node_to_add(self, m: StateMirror, a: Allocation) -> str:
        """The node the solver would give a one-node trial of ``a`` (its constraints, its
        vCluster's pool), from the groups ``a`` already uses when one is free there."""
        trial = msgspec.structs.replace(
            a,
            state=AllocationState.PENDING,
            assigned_nodes=[],
            spec=msgspec.structs.replace(a.spec, nodes=1, min_nodes=0),
        )
        groups = {n.group for nid in a.assigned_nodes if (n := m.nodes.get(nid))}
        near = {nid: n for nid, n in m.nodes.items() if n.group in groups}
        waiting = {m.allocations[aid].spec.vcluster for aid in m.pending}
        lenders = [  # lending idle nodes, with no work of their own waiting (spec: elastic)
            name
            for name, v in sorted(m.vclusters.items())
            if name != a.spec.vcluster
            and v.allow_borrowing
            and v.scheduler_type != SchedulerType.SENSITIVE_RESERVATION
            and name not in waiting
        ]
        tries = [(near, a.spec.vcluster), (m.nodes, a.spec.vcluster)]
        tries += [(m.nodes, lender) for lender in lenders]  # borrowed, beyond min_nodes
        for pool, vcluster in tries:
            # the trial as if submitted to the pool's vCluster: the solver takes its pool
            probe = msgspec.structs.replace(
                trial, spec=msgspec.structs.replace(trial.spec, vcluster=vcluster)
            )
            res = solve(
                [probe],
                pool,
                [],
                score=lambda _a: 0.0,
                now=self.clock(),
                backfill_depth=0,
                vcluster=vcluster,
            )
            if res.proposals:
                return res.proposals[0].node_ids[0]
        return ""

    async def _publish_hold(self, a: Allocation, d: autoscale.Decision) -> None:
        old = a.scaling_status or ScalingStatus()
        new = msgspec.structs.replace(old, target=len(a.assigned_nodes), blocked=d.blocked)
        if new == old:
            return
        try:
            await self.quorum.propose(c.SetScalingStatus(statuses={a.id: new}, now=self.clock()))
        except LatticeError as e:
            log.info("could not publish the scaling status of %s: %s", a.id, e.message)

    async def _propose_scale(
        self,
        a: Allocation,
        cmd: c.ScaleAllocation,
        t: _Track,
        now: float,
        d: autoscale.Decision,
    ) -> bool:
        try:
            res = await self.quorum.propose(cmd)
        except LatticeError as e:
            PROPOSALS.labels("error").inc()
            t.rejections += 1
            t.last_rejection_at = now
            log.warning("scale proposal for %s failed: %s", a.id, e.message)
            return False
        if res.error is not None:
            PROPOSALS.labels("rejected").inc()
            t.rejections += 1
            t.last_rejection_at = now
            log.info(
                "scale %s of %s rejected (%d in a row): %s",
                d.action,
                a.id,
                t.rejections,
                res.error.get("message"),
            )
            return False
        PROPOSALS.labels("accepted").inc()
        t.rejections, t.last_rejection_at = 0, None
        t.samples.clear()  # a new size: the windows start again
        t.events.append(d.action)
        if autoscale.oscillating(t.events):
            log.warning(
                "allocation %s: scale events alternated %d times in a row; widen the gap "
                "between its target and scale_down_threshold or lengthen its cooldown",
                a.id,
                autoscale.alternations(t.events),
            )
        log.info(
            "scaled %s %s to %d nodes: %s",
            a.id,
            d.action,
            len(res.allocation.assigned_nodes) if res.allocation else -1,
            d.reason,
        )
        return True


def _hint_outstanding(a: Allocation) -> bool:
    """A checkpoint hint of this run has no outcome yet (as the quorum counts runs)."""
    h = a.checkpoint_hint
    return h is not None and h.done_at is None and h.run == a.requeue_count + a.preempted_count
