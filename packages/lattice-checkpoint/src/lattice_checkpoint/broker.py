"""The checkpoint broker: every evaluation interval, the cost model over the Running
allocations with ``checkpoint: auto`` and a protocol, and checkpoint hints through the
quorum (``manual`` ones decide for themselves; preemption still asks them).

Stateless like a scheduler: everything it knows comes from the quorum's watch-state
stream (a StateMirror). A hint is a quorum command (``IssueCheckpointHint``) recorded on
the allocation; the head node's agent runs the allocation's checkpoint protocol and
lets it run on ("checkpoint and continue"), and the outcome is recorded on the
allocation. An allocation with a hint outstanding, or checkpointed or hinted within the
last interval, is not hinted again; the quorum itself refuses a second outstanding hint
and a hint from a stale view (``epoch``). So a broker killed at any point and started
again re-evaluates from the quorum's state and never checkpoints an allocation twice.

Storage: a write probe before every evaluation (:class:`StorageProbe`: the
``lattice_checkpoint.storage`` store of the checkpoint root, a directory or S3). Its bandwidth feeds the cost
model's write time; when it fails, hints pause, ``lattice_checkpoint_storage_unavailable``
is 1, and on recovery the allocations with the most recompute to save go first.

Node health: a Degraded node (quorum state) and, with a TSDB, the GPUs' ECC errors and
thermal warnings (:mod:`lattice_checkpoint.health`), the worst over an allocation's
nodes, raise its failure probability.

The scheduler's f8 reads each allocation's ``checkpoint_minutes``, which the broker
publishes (``SetCheckpointEstimates``, only changes) from the last measured checkpoint
or from the size estimate and the measured bandwidth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from lattice_common import commands as c
from lattice_common.errors import LatticeError
from lattice_common.history import HistoryStore
from lattice_common.rpc import RemoteQuorum
from lattice_common.types import Allocation, AllocationState, Node, NodeState
from lattice_common.watch import StateMirror
from prometheus_client import Counter, Gauge, Histogram

from lattice_checkpoint import cost
from lattice_checkpoint.storage.base import CheckpointStore, ProbeResult
from lattice_checkpoint.storage.outage import STORAGE_UNAVAILABLE
from lattice_checkpoint.storage.retention import SweepReport, sweep_expired_checkpoints

log = logging.getLogger("lattice.checkpoint")

EVALUATIONS = Counter(
    "lattice_checkpoint_evaluations_total", "Evaluation passes of the checkpoint cost model"
)
HINTS = Counter(
    "lattice_checkpoint_hints_total",
    "Checkpoint hints proposed to the quorum, by result",
    ["result"],
)
EVAL_DURATION = Histogram(
    "lattice_checkpoint_evaluation_duration_seconds",
    "Time to evaluate the cost model over every running checkpointable allocation",
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
STORAGE_BANDWIDTH = Gauge(
    "lattice_checkpoint_storage_write_bandwidth_bytes",
    "Write bandwidth of the checkpoint destination as last probed (bytes/s)",
)

ESTIMATE_TOLERANCE = 0.05  # relative change of an f8 estimate worth publishing
BANDWIDTH_SMOOTHING = 0.5  # weight of the newest probe in the bandwidth estimate
PROBE_BYTES = 4 << 20
HINT_BATCH = 256  # hints per quorum entry
HINT_ORDER_STEP = 1e-5  # seconds between the recorded times of a batch's hints


# --------------------------------------------------------------------------- storage


class StorageProbe(Protocol):
    """What the broker needs of a checkpoint destination: every
    :class:`lattice_checkpoint.storage.CheckpointStore` is one."""

    async def probe(self) -> ProbeResult: ...


class HealthSource(Protocol):
    """Node id -> health signals (:class:`lattice_checkpoint.health.TsdbHealth`)."""

    async def read(self) -> dict[str, cost.NodeHealth]: ...


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Hint:
    allocation_id: str
    epoch: int
    decision: cost.Decision


@dataclass
class Evaluation:
    decisions: list[cost.Decision] = field(default_factory=list)
    hints: list[Hint] = field(default_factory=list)  # most recompute to save first
    estimates: dict[str, float | None] = field(default_factory=dict)  # changes only
    skipped: dict[str, str] = field(default_factory=dict)  # allocation id -> why


def run_of(a: Allocation) -> int:
    return a.requeue_count + a.preempted_count


def hint_outstanding(a: Allocation) -> bool:
    h = a.checkpoint_hint
    return h is not None and h.done_at is None and h.run == run_of(a)


def _urgency_above(pending: Iterable[Allocation]) -> dict[str, list[float]]:
    """Per vCluster, for each class c: Σ over waiting allocations of a higher class of
    their urgency (class difference / 10)."""
    counts: dict[str, list[int]] = {}
    for a in pending:
        k = min(max(a.spec.preemption_class, 0), cost.PREEMPTION_CLASSES)
        counts.setdefault(a.spec.vcluster, [0] * (cost.PREEMPTION_CLASSES + 1))[k] += 1
    out: dict[str, list[float]] = {}
    for vc, n in counts.items():
        out[vc] = [
            sum(n[k] * (k - c) for k in range(c + 1, len(n))) / cost.PREEMPTION_CLASSES
            for c in range(len(n))
        ]
    return out


def _gpu_hours(a: Allocation, devices_per_node: int) -> float:
    hours = a.spec.walltime_seconds / 3600.0 if a.spec.walltime_seconds else 1.0
    return max(a.spec.nodes, 1) * max(devices_per_node, 1) * hours


def _changed(old: float | None, new: float | None) -> bool:
    if old is None or new is None:
        return old is not new
    return abs(new - old) > ESTIMATE_TOLERANCE * max(abs(old), 1e-3)


def evaluate(
    allocations: Mapping[str, Allocation],
    nodes: Mapping[str, Node],
    now: float,
    storage: cost.StorageView,
    *,
    interval: float,
    params: cost.ModelParams | None = None,
    health: Mapping[str, cost.NodeHealth] | None = None,
) -> Evaluation:
    """One pass of the broker's decisions over a state snapshot (pure). ``health``:
    node id -> its telemetry signals (ECC errors, thermal warnings), when known."""
    params = params or cost.ModelParams()
    ev = Evaluation()
    pending: list[Allocation] = []
    running: list[Allocation] = []
    for a in allocations.values():
        if a.state == AllocationState.PENDING:
            if not a.held:
                pending.append(a)
        elif a.state == AllocationState.RUNNING:
            running.append(a)
    queued_h = sum(_gpu_hours(a, 1) for a in pending)
    running_h = sum(_gpu_hours(a, 1) for a in running)
    total = queued_h + running_h
    pressure = queued_h / total if total > 0 else 0.0
    demand = _urgency_above(pending)
    available = storage.write_bandwidth_bytes_per_s > 0
    facts: dict[str, NodeFacts] = {}
    for a in running:
        for nid in a.assigned_nodes:
            if nid not in facts and (n := nodes.get(nid)) is not None:
                facts[nid] = NodeFacts(n, health.get(nid) if health else None)
    scored: list[Hint] = []
    for a in running:
        # checkpoint: manual leaves the when to the application (preemption still asks)
        if not a.spec.checkpointable or a.spec.checkpoint != "auto":
            continue
        job, measured_secs = job_view(a, facts, now)
        if available:
            est = cost.estimated_checkpoint_minutes(job, storage, params, measured_secs)
            if est is not None:
                est = round(est, 4)
            if _changed(a.checkpoint_minutes, est):
                ev.estimates[a.id] = est
        if hint_outstanding(a):
            ev.skipped[a.id] = "hint_outstanding"
            continue
        ck = a.last_checkpoint
        h = a.checkpoint_hint
        if (ck is not None and now - ck.at < interval) or (h is not None and now - h.at < interval):
            ev.skipped[a.id] = "checkpointed_recently"
            continue
        above = demand.get(a.spec.vcluster)
        queue = cost.QueueView(
            backlog_pressure=pressure,
            higher_class_demand=above[min(max(a.spec.preemption_class, 0), 10)] if above else 0.0,
        )
        d = cost.should_checkpoint(job, storage, queue, params)
        ev.decisions.append(d)
        if d.checkpoint:
            scored.append(Hint(a.id, a.checkpoint_hints, d))
    if available:
        for a in pending:
            if a.spec.checkpointable and a.checkpoint_minutes is None:
                job = cost.JobView(allocation_id=a.id, node_count=max(a.spec.nodes, 1))
                measured = a.last_checkpoint.duration_seconds if a.last_checkpoint else None
                est = cost.estimated_checkpoint_minutes(job, storage, params, measured)
                if est is not None:
                    ev.estimates[a.id] = round(est, 4)
    ev.hints = sorted(scored, key=lambda h: -h.decision.value.recompute_saved)
    return ev


class NodeFacts:
    """What the cost model needs of a node, read once per evaluation pass."""

    __slots__ = ("degraded", "ecc", "gpu_memory", "gpus", "home", "thermal")

    def __init__(self, n: Node, health: cost.NodeHealth | None = None) -> None:
        caps = n.capabilities
        self.gpus = len(caps.gpus) or caps.gpu_count
        self.gpu_memory = float(sum(g.memory_bytes for g in caps.gpus)) if caps.gpus else 0.0
        self.degraded = n.state == NodeState.DEGRADED
        self.home = n.home_vcluster
        self.ecc = health.ecc_errors if health is not None else 0
        self.thermal = health.thermal_warnings if health is not None else 0


def job_view(
    a: Allocation, facts: Mapping[str, NodeFacts], now: float
) -> tuple[cost.JobView, float | None]:
    """The cost model's view of a Running allocation, and its last checkpoint's
    measured duration (None: none yet)."""
    assigned = a.assigned_nodes
    head = facts.get(assigned[0]) if assigned else None
    # the worst of its nodes: one failing node loses the whole run
    degraded = False
    ecc = thermal = 0
    for nid in assigned:
        f = facts.get(nid)
        if f is not None:
            degraded = degraded or f.degraded
            ecc = f.ecc if f.ecc > ecc else ecc
            thermal = f.thermal if f.thermal > thermal else thermal
    start = a.started_at if a.started_at is not None else now
    ck = a.last_checkpoint
    last = ck.at if ck is not None and ck.at >= start else start
    walltime = a.spec.walltime_seconds
    health = _DEGRADED if degraded else _HEALTHY
    if ecc or thermal:
        health = cost.NodeHealth(ecc_errors=ecc, thermal_warnings=thermal, degraded=degraded)
    job = cost.JobView(
        allocation_id=a.id,
        node_count=len(assigned) or 1,
        gpus_per_node=head.gpus if head is not None else 0,
        gpu_memory_bytes_per_node=head.gpu_memory if head is not None else 0.0,
        running_seconds=now - start if now > start else 0.0,
        seconds_since_checkpoint=now - last if now > last else 0.0,
        walltime_remaining_seconds=start + walltime - now if walltime else None,
        preemption_class=a.spec.preemption_class,
        borrowed=head is not None and head.home not in ("", a.spec.vcluster),
        measured_checkpoint_bytes=ck.size_bytes if ck is not None and ck.size_bytes > 0 else None,
        health=health,
    )
    return job, (ck.duration_seconds if ck is not None else None)


_HEALTHY = cost.NodeHealth()
_DEGRADED = cost.NodeHealth(degraded=True)


# --------------------------------------------------------------------------- service


@dataclass
class Retention:
    """Checkpoint retention (spec: Data Retention, 7 days after completion by
    default): ``store`` is swept every ``interval`` seconds; ``history`` answers for
    allocations that already left the quorum's state (after 24 h by default)."""

    store: CheckpointStore
    seconds: float
    history: HistoryStore | None = None
    interval: float = 3600.0


class Broker:
    def __init__(
        self,
        quorum: RemoteQuorum,
        probe: StorageProbe,
        *,
        interval: float = 30.0,
        params: cost.ModelParams | None = None,
        storage_cost_gpu_hours_per_gb: float = cost.DEFAULT_STORAGE_COST_GPU_HOURS_PER_GB,
        reconnect_delay: float = 0.5,
        health: HealthSource | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.quorum = quorum
        self.health = health
        self.retention = retention
        self._swept_at = -math.inf
        self.probe = probe
        self.interval = interval
        self.params = params or cost.ModelParams()
        self.storage_cost = storage_cost_gpu_hours_per_gb
        self.reconnect_delay = reconnect_delay
        self.mirror = StateMirror()
        self.synced = asyncio.Event()
        self.bandwidth = 0.0
        self.storage_ok: bool | None = None  # None: not probed yet
        self.last: Evaluation | None = None

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch(), name="watch-state")
        try:
            await self.synced.wait()
            while True:
                t0 = time.monotonic()
                try:
                    await self.evaluate_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("evaluation failed (retrying next interval)")
                await self._sweep_when_due()
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            self.quorum.endpoints.close()

    async def _sweep_when_due(self) -> None:
        r = self.retention
        if r is None or not self.storage_ok or time.monotonic() - self._swept_at < r.interval:
            return
        self._swept_at = time.monotonic()
        try:
            await self.sweep_retention()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("checkpoint retention sweep failed (retrying in %.0fs)", r.interval)

    async def sweep_retention(self, now: float | None = None) -> SweepReport | None:
        """Delete the checkpoints of allocations that ended longer ago than the
        retention. Live allocations are judged from the watch mirror, those that already
        left the quorum's state from the history store; allocations neither knows are
        kept."""
        r = self.retention
        if r is None:
            return None

        async def lookup(ids: list[str]) -> list[Allocation]:
            known = [self.mirror.allocations[i] for i in ids if i in self.mirror.allocations]
            gone = [i for i in ids if i not in self.mirror.allocations]
            if gone and r.history is not None:
                known.extend((await r.history.get_many(gone)).values())
            return known

        report = await sweep_expired_checkpoints(
            r.store, lookup, now=time.time() if now is None else now, retention_seconds=r.seconds
        )
        if report.deleted:
            log.info(
                "checkpoint retention: deleted the checkpoints of %d ended allocation(s)",
                len(report.deleted),
            )
        return report

    async def _watch(self) -> None:
        while True:
            try:
                async for delta in self.quorum.watch():
                    self.mirror.apply(delta)
                    if delta.snapshot:
                        self.synced.set()
            except LatticeError as e:
                log.warning("watch-state stream lost (%s); reconnecting", e.message)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watch-state stream failed; reconnecting")
            await asyncio.sleep(self.reconnect_delay)

    async def check_storage(self) -> cost.StorageView:
        r = await self.probe.probe()
        if r.ok and r.write_bandwidth_bytes_per_s > 0:
            if self.storage_ok is False:
                log.warning("checkpoint storage is back; hints resume, most at risk first")
            self.storage_ok = True
            self.bandwidth = (
                r.write_bandwidth_bytes_per_s
                if self.bandwidth <= 0
                else BANDWIDTH_SMOOTHING * r.write_bandwidth_bytes_per_s
                + (1 - BANDWIDTH_SMOOTHING) * self.bandwidth
            )
            STORAGE_UNAVAILABLE.set(0)
            STORAGE_BANDWIDTH.set(self.bandwidth)
            return cost.StorageView(self.bandwidth, self.storage_cost)
        if self.storage_ok is not False:
            log.error(
                "checkpoint storage unavailable (%s); hints paused", r.error or "no bandwidth"
            )
        self.storage_ok = False
        STORAGE_UNAVAILABLE.set(1)
        return cost.StorageView(0.0, self.storage_cost)

    async def evaluate_once(self) -> Evaluation:
        storage = await self.check_storage()
        health = await self.health.read() if self.health is not None else None
        t0 = time.perf_counter()
        ev = evaluate(
            self.mirror.allocations,
            self.mirror.nodes,
            time.time(),
            storage,
            interval=self.interval,
            params=self.params,
            health=health,
        )
        EVAL_DURATION.observe(time.perf_counter() - t0)
        EVALUATIONS.inc()
        self.last = ev
        await self._hint(ev.hints)
        await self._publish(ev.estimates)
        return ev

    async def _hint(self, hints: list[Hint]) -> None:
        for i in range(0, len(hints), HINT_BATCH):
            await self._hint_batch(hints[i : i + HINT_BATCH])

    async def _hint_batch(self, hints: list[Hint]) -> None:
        now = time.time()
        # each hint's time is its place in the order (most recompute to save first),
        # so the quorum's records show the order the hints went out in
        cmds: list[c.Command] = [
            c.IssueCheckpointHint(
                allocation_id=h.allocation_id,
                epoch=h.epoch,
                reason=h.decision.reason,
                now=now + i * HINT_ORDER_STEP,
            )
            for i, h in enumerate(hints)
        ]
        try:
            res = await self.quorum.propose(c.Batch(commands=cmds, now=now))
        except LatticeError as e:
            HINTS.labels("error").inc(len(hints))
            log.warning("checkpoint hints failed: %s", e.message)
            return
        for h, r in zip(hints, res.results or [], strict=False):
            if r.error is None:
                HINTS.labels("accepted").inc()
                log.info("hinted %s to checkpoint: %s", h.allocation_id, h.decision.explain())
            else:
                HINTS.labels("rejected").inc()
                log.info("hint for %s refused: %s", h.allocation_id, r.error.get("message"))

    async def _publish(self, estimates: dict[str, float | None]) -> None:
        if not estimates:
            return
        try:
            await self.quorum.propose(c.SetCheckpointEstimates(minutes=estimates, now=time.time()))
        except LatticeError as e:
            log.info("could not publish checkpoint estimates: %s", e.message)
